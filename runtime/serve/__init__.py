"""Serving: an OpenAI-compatible HTTP server with continuous batching (``tfport serve``).

``scheduler`` (continuous batching over ``decoding.rows``; numpy + onnxruntime only) needs no
extra; ``app`` (FastAPI), ``metrics`` (prometheus-client) and ``cli`` need the ``serve`` extra,
``ray_serve`` the ``serve-ray`` extra. Nothing here imports torch.
"""

from .scheduler import (Failed, Finished, GenerationRequest, Handle, QueueFull, Scheduler,
                        SchedulerLimits, Token)

__all__ = ["Scheduler", "SchedulerLimits", "GenerationRequest", "Handle", "QueueFull", "Token",
           "Finished", "Failed"]
