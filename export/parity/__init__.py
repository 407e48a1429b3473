"""Parity: an export against its PyTorch reference, case by case, with localisation.

``cases`` (Case, tolerances, comparison), ``inputs`` (inputs per family and cache layout),
``reference`` (the module in the export's dtype, its cache rounded to the export's cache dtype),
``runner`` (sessions, running and checking, the post-export validation), ``localize`` (forward
hooks and graph taps: the first diverging layer and piece), ``cli`` (``tfport parity``).
"""

from .cases import CASES, PHASES, TOLERANCES, Case, CaseResult, Diff, token_agreement
from .inputs import CaseInputs, Prepared
from .localize import capture, first_divergence, localize
from .reference import reference_module
from .runner import PROVIDERS, Runner, cuda_available, make_session, validate_export

__all__ = ["CASES", "PHASES", "TOLERANCES", "Case", "CaseResult", "Diff", "token_agreement",
           "CaseInputs", "Prepared", "capture", "first_divergence", "localize",
           "PROVIDERS", "Runner", "cuda_available", "make_session", "validate_export", "reference_module"]
