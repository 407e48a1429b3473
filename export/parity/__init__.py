"""Parity: an export against its PyTorch reference, case by case, with localisation.

``cases`` (Case, tolerances, comparison), ``inputs`` (inputs per family and cache layout),
``reference`` (the module in the export's dtype, its cache rounded to the export's cache dtype),
``runner`` (running and checking, the post-export validation; sessions from ``export/validate.py``),
``localize`` (forward hooks and graph taps: the first diverging layer and piece). The command,
``tfport parity``, and its accuracy measures are ``tfport.tools.parity``.
"""

from ..validate import PROVIDERS, cuda_available, make_session
from .cases import CASES, PHASES, TOLERANCES, Case, CaseResult, Diff, token_agreement
from .inputs import CaseInputs, Prepared
from .localize import capture, first_divergence, localize
from .reference import reference_module
from .runner import Runner, validate_export

__all__ = ["CASES", "PHASES", "TOLERANCES", "Case", "CaseResult", "Diff", "token_agreement",
           "CaseInputs", "Prepared", "capture", "first_divergence", "localize",
           "PROVIDERS", "Runner", "cuda_available", "make_session", "validate_export", "reference_module"]
