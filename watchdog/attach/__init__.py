"""Attachment points: they decide *when* ``Watchdog.observe`` runs and *what* the roots are.

* ``model.py``: ``watch_model`` / ``unwatch_model``, every forward pass of a model given a cache.
* ``decorator.py``: ``@watch``, a generate function with mlx-lm's calling convention.
* ``step.py``: ``watch_step``, a bare step function.
* ``server.py``: ``mlx_lm.server``'s hooks (``mlx-watchdog serve``).
* ``prefill.py``: the prefill guard (installed on the model and on its watchdog).
* ``distributed.py``: ranks that stop together, once ``instrument()`` is called (importing
  ``mlx_watchdog`` patches nothing).
"""
