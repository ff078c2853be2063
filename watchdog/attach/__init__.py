"""Attachment points: they decide *when* ``Watchdog.observe`` runs and *what* the roots are.

* ``model.py``: ``watch_model`` / ``unwatch_model``, every forward pass of a model given a cache.
* ``decorator.py``: ``@watch``, a generate function with mlx-lm's calling convention.
* ``step.py``: ``watch_step``, a bare step function.
* ``server.py``: ``mlx_lm.server``'s hooks (``mlx-watchdog serve``).
* ``prefill.py``: the prefill guard (installed on the model and on its watchdog).
* ``distributed.py``: ranks that stop together, once ``instrument()`` is called (importing
  ``mlx_watchdog`` patches nothing).
* ``loaders.py``: ``instrument()``, every model loaded through mlx-lm's or mlx-vlm's loader.
* ``compiled.py``: ``mx.compile`` wrapped (its ``instrument()``): every compiled function's traces
  and signatures counted; ``training.py``: every compiled training step observed per step, a stop
  saving the adapters first; ``imports.py``: the import hook both use.
"""
