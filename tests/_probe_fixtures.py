"""Probes with a chosen output level or an input-dependent output, for runtime and verifier tests."""
import torch

from specprobe.probes.features import FeatureSpec
from specprobe.probes.mlp import ProbeMLPConfig, SemanticProbe


def _probe(engine, bias: float, seed: int, layers: str, out_scale: float) -> SemanticProbe:
    spec = FeatureSpec(engine.info.model_id, engine.info.num_layers, engine.info.hidden_size, layers=layers)
    torch.manual_seed(seed)
    probe = SemanticProbe(spec, ProbeMLPConfig(hidden_dim=8, dropout=0.0)).eval()
    with torch.no_grad():
        probe.mlp[-1].weight.mul_(out_scale)
        probe.mlp[-1].bias.fill_(bias)
    return probe


def make_probe(engine, bias: float, seed: int = 0, layers: str = "all") -> SemanticProbe:
    """Random small MLP whose output is ~sigmoid(bias) whatever the input."""
    return _probe(engine, bias, seed, layers, 0.01)


def make_input_probe(engine, bias: float = 0.0, seed: int = 0, layers: str = "last") -> SemanticProbe:
    """Random small MLP whose output moves with its input (hidden states of different steps give different
    probabilities): for tests that must notice which step's features a verifier was given."""
    return _probe(engine, bias, seed, layers, 20.0)
