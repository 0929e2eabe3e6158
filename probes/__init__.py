"""Probe and verifier models, their save/load, acceptance rules, metrics and speedup formulas.

Pure torch / numpy / scipy / scikit-learn: nothing here imports language-model code.
"""
from .acceptance import DEFAULT_EPS, bernoulli, make_rng, semantic_accept_prob
from .features import FeatureSpec, layers_from_option
from .metrics import (
    BootstrapCI,
    ReliabilityBins,
    auprc,
    auroc,
    bootstrap_ci,
    brier,
    brier_skill,
    ece,
    label_noise_floor,
    log_loss,
    mae,
    mce,
    probe_report,
    reliability_bins,
    spearman,
)
from .mlp import FitHistory, ProbeMLPConfig, SemanticProbe, fit_probe
from .speedup import (
    async_speedup,
    sync_speedup,
    token_sd_speedup,
)
from .splits import group_split
from .threshold import OperatingPoint, ThresholdFit, fit_threshold

__all__ = [
    "FeatureSpec", "layers_from_option",
    "SemanticProbe", "ProbeMLPConfig", "FitHistory", "fit_probe",
    "ThresholdFit", "OperatingPoint", "fit_threshold",
    "ece", "mce", "brier", "brier_skill", "log_loss", "label_noise_floor", "mae", "spearman", "auroc", "auprc",
    "reliability_bins", "ReliabilityBins",
    "bootstrap_ci", "BootstrapCI", "probe_report",
    "semantic_accept_prob", "make_rng", "bernoulli", "DEFAULT_EPS",
    "token_sd_speedup", "sync_speedup", "async_speedup",
    "group_split",
]
