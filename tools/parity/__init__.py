"""``tfport parity``: an export against its PyTorch reference, case by case, from the command line.

``cli`` (the command: cases, localisation of a failure, ``--accuracy``) and ``accuracy``
(perplexity, KL divergence, top-token agreement and chat answers of an export under the runtime,
against its reference module; also what ``tfport bench --pareto`` measures). The comparison
itself, which every export runs to validate itself, is ``tfport.export.parity``.
"""
