"""Resumable judge-LoRA training: every ``verifiers.judge_save_every`` steps the loop's whole state goes to a folder
beside the checkpoint, and the same command run again continues from the last one written.

The state is everything the next step reads: the adapter's trainable weights, AdamW's moments and step counts, the
RNGs (the pair order's numpy generator and torch's, which draws LoRA dropout), the position in the shuffled order
and the losses so far; also the untrained base's probabilities on the validation and test pairs, so a resumed run
does not score them again. One safetensors file per saved step holds the tensors and ``state.json`` names it; the
JSON is written last (atomically), so a kill during a save leaves the previous state readable. Losses and
probabilities are tensors too: a NaN loss (a diverging bf16 run) is kept as it is, not refused by JSON.

A state is taken only by a run whose pairs and judge settings are the ones it was trained with (``run_key``); a
larger ``judge_steps`` continues it (AdamW here has no schedule, so steps 1..n are the same in both runs).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specprobe.inputs.config import config_diff
from specprobe.probes.io import FileFormatError, load_tensors, read_json, save_tensors, write_json

FORMAT = "specprobe-judge-steps"
STATE = "state.json"
# settings that do not change what the steps compute: how often to save, how many steps there are (a larger
# judge_steps continues an earlier state; a smaller one than the state's is refused in `earlier`), and how many
# pairs are scored after training (other eval pairs only mean scoring the base again: `Earlier.base_probs_for`)
NOT_IN_KEY = ("judge_save_every", "judge_steps", "judge_eval_pairs")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def run_key(vcfg, dtype: str, device: str, items: Sequence, labels: np.ndarray) -> dict:
    """What makes two runs' steps the same: the judge's settings, its base's dtype and device type (CPU and CUDA
    draw dropout from different generators and round differently) and the training pairs."""
    settings = {k: v for k, v in vars(vcfg).items() if k.startswith("judge_") and k not in NOT_IN_KEY}
    return {"settings": {**settings, "seed": vcfg.seed, "dtype": dtype, "device": device},
            "train_pairs_sha256": _digest([list(items), np.asarray(labels, dtype=bool).tolist()])}


def _comparable(key: dict) -> dict:
    """A stored key as `run_key` writes it now: a state written before a setting (judge_eval_pairs) or the eval
    pairs left the key still continues."""
    settings = {k: v for k, v in (key.get("settings") or {}).items() if k not in NOT_IN_KEY}
    return {**{k: v for k, v in key.items() if k != "eval_pairs_sha256"}, "settings": settings}


def eval_digests(evals: dict[str, tuple[Sequence, np.ndarray]]) -> dict[str, str]:
    """Which pairs the base was scored on, per split (a state's base scores serve only the same pairs)."""
    return {split: _digest([list(it), np.asarray(lab, dtype=bool).tolist()]) for split, (it, lab) in sorted(evals.items())}


@dataclass
class LoopState:
    """The training loop's host-side state between two steps."""

    step: int  # steps done
    order: np.ndarray  # the current shuffled order of the training pairs
    pos: int  # the next pair in `order`
    rng: np.random.Generator  # draws the next order
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0  # training time spent in earlier runs

    @classmethod
    def fresh(cls, n_items: int, seed: int) -> LoopState:
        rng = np.random.default_rng(seed + 1)
        return cls(0, rng.permutation(n_items), 0, rng)

    def next_batch(self, batch_size: int) -> np.ndarray:
        if self.pos + batch_size > len(self.order) and self.pos > 0:
            self.order, self.pos = self.rng.permutation(len(self.order)), 0
        idx = self.order[self.pos:self.pos + batch_size]
        self.pos += len(idx)
        return idx


@dataclass
class Earlier:
    """A state an earlier run left, checked against this run."""

    state: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def base_probs(self) -> dict[str, np.ndarray]:
        return {k.removeprefix("base_probs."): t.numpy() for k, t in self.tensors.items() if k.startswith("base_probs.")}

    def base_probs_for(self, evals_sha256: dict[str, str]) -> dict[str, np.ndarray] | None:
        """The base's scores the earlier run kept, if it scored the same eval pairs (else None: score again)."""
        return self.base_probs if self.state.get("eval_pairs_sha256") == evals_sha256 else None


def cuda_devices(model) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def seed_generators(model, seed: int) -> None:
    """Seed torch's CPU generator and those of the CUDA devices the model is on (dropout draws from them), not the
    others: the caller forks exactly these (`torch.random.fork_rng(devices=cuda_devices(model))`)."""
    torch.default_generator.manual_seed(seed)
    for device in cuda_devices(model):
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)


class JudgeSteps:
    """The folder where one judge-LoRA training keeps its state (``every`` steps apart; 0: never)."""

    def __init__(self, folder: str | Path, every: int, key: dict[str, Any], evals_sha256: dict[str, str] | None = None):
        self.folder, self.every, self.key = Path(folder), int(every), key
        self.evals_sha256 = evals_sha256 or {}  # the pairs `base_probs` scored (`eval_digests`)
        self.saved = False  # the folder holds a state of this training (this run's, or the one it continues)
        self.saved_step = 0  # the step of that state
        self.base_probs: dict[str, np.ndarray] = {}

    def due(self, step: int, last: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last)

    def earlier(self, steps: int) -> tuple[Earlier | None, str]:
        """The state an earlier run of this training left, if this run can continue it, and a line saying what
        was found ("" when the folder holds nothing)."""
        path = self.folder / STATE
        if not path.is_file():
            return None, ""
        try:
            state = read_json(path)
            if state.get("format") != FORMAT:
                raise FileFormatError(f"{path} is not a {FORMAT} state")
            tensors_file = self.folder / state["file"]
            step = int(state["step"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            return None, f"{self.folder} holds an unreadable judge-LoRA state ({err}); training from step 0"
        stored = state.get("key") or {}
        if "eval_pairs_sha256" in stored:  # written while the eval pairs were in the key: they name its base scores
            state.setdefault("eval_pairs_sha256", stored["eval_pairs_sha256"])
        if _comparable(stored) != self.key:
            differ = config_diff(_comparable(stored), self.key)
            return None, (f"{self.folder} holds an earlier judge-LoRA training with other pairs or settings "
                          f"({'; '.join(differ[:4])}); training from step 0 (its state is replaced)")
        if step > steps:
            return None, (f"{self.folder} holds a judge-LoRA state after step {step}, more than "
                          f"verifiers.judge_steps={steps}; training from step 0 (its state is replaced)")
        try:
            tensors = load_tensors(tensors_file)
        except (OSError, ValueError) as err:
            return None, f"{tensors_file} (named by {path}) cannot be read ({err}); training from step 0"
        return Earlier(state, tensors), (
            f"judge LoRA: resuming after step {step} of {steps} from {self.folder} (an earlier run of this config "
            f"stopped there; delete that folder to train from step 0)")

    def save(self, model, opt, loop: LoopState, seconds: float) -> None:
        """Write the state after `loop.step` steps: tensors first, then the JSON that names them."""
        tensors = {f"adapter.{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad}
        for index, moments in opt.state_dict()["state"].items():
            tensors.update({f"optimizer.{index}.{name}": t for name, t in moments.items()})
        tensors["loop.losses"] = torch.tensor(loop.losses, dtype=torch.float64)
        tensors.update({f"base_probs.{split}": torch.as_tensor(p, dtype=torch.float64)
                        for split, p in self.base_probs.items()})
        tensors["rng.torch"] = torch.get_rng_state()
        for device in cuda_devices(model):
            tensors[f"rng.cuda.{device}"] = torch.cuda.get_rng_state(device)
        name = f"step-{loop.step:07d}.safetensors"
        save_tensors(self.folder / name, tensors)
        write_json(self.folder / STATE, {
            "format": FORMAT, "version": 1, "key": self.key, "eval_pairs_sha256": self.evals_sha256,
            "step": loop.step, "file": name,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "order": loop.order.tolist(), "pos": loop.pos,
            "numpy_rng": loop.rng.bit_generator.state, "seconds": loop.seconds + seconds})
        for old in self.folder.glob("step-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)
        self.saved, self.saved_step = True, loop.step

    @staticmethod
    def restore(earlier: Earlier, model, opt) -> LoopState:
        """Put an earlier state into the (fresh) adapter, optimizer and RNGs; the loop state to continue with."""
        tensors = earlier.tensors
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        saved = {k.removeprefix("adapter."): t for k, t in tensors.items() if k.startswith("adapter.")}
        if set(saved) != set(params):
            raise FileFormatError(f"the judge-LoRA state after step {earlier.step} holds other adapter weights than "
                                  "this model's LoRA; delete its folder to train from step 0")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])
        sd = opt.state_dict()
        moments: dict[int, dict[str, torch.Tensor]] = {}
        for k, t in tensors.items():
            if k.startswith("optimizer."):
                _, index, name = k.split(".", 2)
                moments.setdefault(int(index), {})[name] = t
        sd["state"] = moments
        opt.load_state_dict(sd)
        torch.set_rng_state(tensors["rng.torch"])
        for device in cuda_devices(model):
            if f"rng.cuda.{device}" in tensors:
                torch.cuda.set_rng_state(tensors[f"rng.cuda.{device}"], device)
        s = earlier.state
        rng = np.random.default_rng()
        rng.bit_generator.state = s["numpy_rng"]
        return LoopState(int(s["step"]), np.asarray(s["order"], dtype=np.int64), int(s["pos"]), rng,
                         tensors["loop.losses"].tolist(), float(s.get("seconds", 0.0)))


def remove_state(folder: str | Path) -> bool:
    """Delete a training state folder (once a checkpoint holds the trained judge); whether there was one."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True
