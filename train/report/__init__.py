"""probe-eval: calibration, baselines, layer sweep, hidden-state view and pair verifiers of a checkpoint.

Layers: `evaluate` (numbers -> dicts, no figures), `inputs` (checkpoint, data, held-out questions),
`sections` / `verifiers` (the report's parts), `plots` (matplotlib Agg), `render` (markdown), `runner`
(`evaluate_checkpoint`, `compare_checkpoints`). The CLI is `specprobe.train.eval_cli` (`probe-eval`).
"""
from specprobe.train.report.inputs import CheckpointError, PartError
from specprobe.train.report.runner import Report, compare_checkpoints, evaluate_checkpoint

__all__ = ["evaluate_checkpoint", "compare_checkpoints", "Report", "CheckpointError", "PartError"]
