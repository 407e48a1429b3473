"""Tools built on the exporter and the runtime, and on nothing that imports them.

``bench/`` (``tfport bench``, ``tfport bench-scale``: decode speed, engine comparisons, accuracy
against speed), ``parity/`` (``tfport parity``: an export against its PyTorch reference, with
``--accuracy``'s perplexity, KL divergence and chat answers), ``serve_bench.py`` (``tfport
bench-serve``: a load test of a server on this machine) and ``hostile.py`` (a hostile client of
``tfport serve``). The libraries (``tfport``, ``tfport.models``, ``tfport.export``,
``tfport.runtime``) never import this package; ``tests/core/test_imports.py`` checks it.
"""
