"""The watchdog itself: what it reads, how it counts, when it walks, what it forecasts, the fix.

Nothing here knows how it is attached (``mlx_watchdog.attach``), run from the command line
(``mlx_watchdog.commands``) or exported (``mlx_watchdog.exporters``): those depend on the core,
never the reverse.

* ``watchdog.py``: ``Watchdog``: ``observe`` at each step, ``forecast``, the fix and the actions.
  ``snapshot.py``: what the exporters read of one, at one moment; ``live.py``: the live watchdogs
  and which of them the metrics endpoint shows.
* Reading the caches: ``objects.py`` reads Python objects through their types only (no program
  code runs); ``arrays.py`` finds every ``mx.array`` reachable from the roots, with its path and
  site; ``caches.py`` keeps the caches followed (every live cache seen in a forward);
  ``rows.py`` sees a batch filtered or extended in place (the same caches, other rows).
* Counting: ``graph.py`` counts one walk of the lazy graph (``mx.export_to_dot``);
  ``sampling.py`` decides whether a reading walks every pending array or a sample;
  ``reading.py`` turns what a walk found into a value, a ``Reading`` (by cache, by site, what is
  resident, kept and pending), by arithmetic alone;
  ``allocator.py`` settles the C allocator's deferred work before a walk is timed.
* The watchdog's parts: ``counters.py`` (its public counters, in one object), ``pace.py`` (the
  step clock: when the steps came, their rate, idleness), ``epochs.py`` (the sets of live caches,
  and the roots of the last step).
* Over time: ``schedule.py`` (when to walk, within the budget), ``growth.py`` (readings ->
  rate and leak sites), ``forecast.py`` (robust slopes, the step and time of the limit),
  ``attribution.py`` (the source line that rebinds a leaking attribute).
* Acting: ``fix.py`` (schedule evaluation of the pending cache arrays that leak), ``actions.py``
  (stop, warn).
* Other processes: ``coordination.py`` (the one hook for them, a coordinator that an attachment
  installs, and the rank and world size the launcher's variables give).
* ``clock.py``: every clock the watchdog reads (wall and CPU time), read from there alone.
* ``compiled.py``: the compiled functions of the process (``mx.compile``'s cache entries, one per
  input signature), a site ``compiled:<function>`` of every watchdog's reading.
* ``census.py``: the program's own objects that hold pending arrays outside the caches, found from
  the garbage collector's view, each attribute a site ``outside:<module>.<Class>.<attribute>``.
* ``limits.py`` (the device's buffer limit, an exact counter where MLX has one),
  ``options.py`` (the bounds of every option), ``chunks.py`` (a prefill chunk's buffers as a
  line over its length, and the largest chunk under a budget).
"""
