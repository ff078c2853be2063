"""A reading as a value: what one walk found, tallied by cache and by site, and what is resident.

A walk (``Watchdog``) finds the arrays of every cache in scope (``arrays.py``) and the sampler
(``sampling.py``) tells, array by array, which are evaluated and how many buffers each pending
one's graph retains. ``read()`` turns that into a :class:`Reading`, by arithmetic alone (no MLX,
no clock, no state):

* by cache: each followed cache's buffers and what its pending graphs retain (a cache that dies
  takes them with it, and its share of the growth);
* by site: each site's evaluated arrays, what its pending ones retain, a few of their paths, and
  each array as a chain to follow to the next reading (``growth.py``);
* resident: the model's parameters, the evaluated arrays, the buffers pending graphs retain and
  the compiled functions' entries (``compiled.py``); MLX's own count instead where it has one;
* the sample the growth is fitted on: what is resident, less in fix mode what the fix cuts;
* kept: the buffers of a server's kept caches (``caches.py``), fitted apart;
* pending: the arrays still lazy and their graphs' nodes.

Between readings the forecast extrapolates from the last one (``Watchdog.forecast``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

MAX_PATHS_PER_SITE = 16  # paths of pending arrays kept per site (the leak's examples)


class FoundArray(Protocol):
    """One array a walk found (``arrays.Found``), as a reading sees it."""

    @property
    def site(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def root(self) -> int:
        """Which root of the walk it was found from (0: the step's roots)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class SiteTally:
    """One site's arrays in one reading."""

    held: int = 0  # evaluated arrays: a buffer each
    retained: float = 0.0  # buffers the graphs of its pending arrays keep alive
    paths: tuple[str, ...] = ()  # some of those pending arrays
    arrays: int = 0
    # Each array: (its key, the cache's weak reference or None, retained, walked now): followed to
    # the next reading by its key, while its cache is the same object.
    chains: tuple[tuple[tuple, Any, float, bool], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class CacheTally:
    """A followed cache's buffers in one reading. When the cache dies they go with it, before the
    next reading sees it (a request ended between two scrapes), and so does its share of the
    growth (chains grow, evaluated arrays do not)."""

    ref: Any  # the cache's weak reference, while the scope follows it
    buffers: float = 0.0  # evaluated arrays, and the buffers their pending graphs retain
    retained: float = 0.0  # of which retained by pending graphs

    @property
    def alive(self) -> bool:
        return self.ref is not None and self.ref() is not None


@dataclasses.dataclass(frozen=True)
class Reading:
    """One reading. Between readings the forecast extrapolates from the last one."""

    step: int = 0
    resident: float = 0.0  # the buffers the forecast counts (see read())
    cache_buffers: int = 0  # evaluated arrays
    retained: int = 0  # buffers retained by pending graphs
    pending_nodes: int = 0
    sampled: bool = False  # some pending arrays were estimated, not walked (sampling.py)
    by_cache: tuple[CacheTally, ...] = ()  # the caches followed
    mlx_cached: int = 0  # buffers in MLX's cache, read from MLX's own counter (0 without one)
    pending_arrays: int = 0  # of the arrays walked (or, sampled, estimated), those still lazy
    fixed_at: int = 0  # the step of the last fix before the reading (in fix mode)
    by_site: Mapping[str, SiteTally] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    walked: float = 0.0  # what the walk counted: resident, but for MLX's or the process's count
    sample: float | None = None  # the buffers the growth is fitted on (None: nothing was found)
    kept: float | None = None  # the kept caches' buffers (None: nothing was found)
    kept_since: int | None = None  # the last forward of the newest kept cache

    def less_freed(self, freed: Mapping[int, float]) -> Reading:
        """The reading after the fix cut chains of kept caches (``freed``: by the cache's id, the
        buffers it freed): out of what is resident, and of those caches' tallies (they would
        leave twice when the caches die)."""
        by_cache = []
        for cache in self.by_cache:
            member = cache.ref() if cache.ref is not None else None
            cut = freed.get(id(member), 0.0) if member is not None else 0.0
            if cut:
                cache = CacheTally(cache.ref, max(0.0, cache.buffers - cut), max(0.0, cache.retained - cut))
            by_cache.append(cache)
        total = sum(freed.values())
        return dataclasses.replace(self, by_cache=tuple(by_cache), resident=self.resident - total)

    def with_outside(self, held: float, sites: Mapping[str, SiteTally]) -> Reading:
        """The reading with ``held`` buffers of the program's own objects outside the caches
        (``census.py``): resident, and in the growth's sample, under ``sites`` of their own."""
        if not held and not sites:
            return self
        by_site = {**self.by_site, **sites}
        return dataclasses.replace(
            self,
            resident=self.resident + held,
            walked=self.walked + held,
            sample=None if self.sample is None else self.sample + held,
            by_site=types.MappingProxyType(by_site),
        )

    def gone(self) -> tuple[float, float]:
        """What the caches dead since the reading took with them: their buffers, and the share of
        the growth that goes on in the caches alive (chains grow, evaluated arrays do not)."""
        caches = self.by_cache
        dead = [cache for cache in caches if not cache.alive]
        chains = sum(cache.retained for cache in caches)
        dead_chains = sum(cache.retained for cache in dead)
        if chains:
            alive_share = 1.0 - dead_chains / chains
        else:
            alive_share = float(len(dead) < len(caches) or not caches)
        return sum(cache.buffers for cache in dead), alive_share


@dataclasses.dataclass(slots=True)
class SiteCount:
    """A site's arrays being counted (``read()``, the census's objects): ``tally()`` is the value."""

    held: int = 0
    retained: float = 0.0
    paths: list[str] = dataclasses.field(default_factory=list)
    arrays: int = 0
    chains: list[tuple[tuple, Any, float, bool]] = dataclasses.field(default_factory=list)

    def add(self, key: tuple, ref: Any, path: str, done: bool, retained: float, walked: bool) -> None:
        """One array of the site: evaluated (``done``, a buffer) or pending, retaining ``retained``
        (``walked``: read whole now, not estimated)."""
        self.arrays += 1
        self.chains.append((key, ref, 0.0 if done else retained, done or walked))
        if done:
            self.held += 1
            return
        self.retained += retained
        if retained and len(self.paths) < MAX_PATHS_PER_SITE:
            self.paths.append(path)

    def tally(self) -> SiteTally:
        return SiteTally(self.held, self.retained, tuple(self.paths), self.arrays, tuple(self.chains))


@dataclasses.dataclass(slots=True)
class _Cache:  # a CacheTally being counted
    ref: Any
    buffers: float = 0.0
    retained: float = 0.0


def read(  # noqa: PLR0913  (keyword-only: what one walk measured, named)
    found: Sequence[FoundArray],
    evaluated: Sequence[bool],
    retained: Sequence[float],
    *,
    step: int,
    keys: Sequence[tuple],
    refs: Mapping[int, Any],
    walked: Collection[int] | None = None,
    kept: Sequence[bool] = (False,),
    kept_since: int | None = None,
    pending_nodes: float = 0.0,
    sampled: bool = False,
    parameters: int = 0,
    compiled: Mapping[str, tuple[int, int]] | None = None,
    compiled_sites: bool = True,
    mlx_count: tuple[int, int] | None = None,
    fixing: bool = False,
    fixed_at: int = 0,
) -> Reading:
    """The reading of the arrays a walk ``found`` at ``step``: ``evaluated`` and ``retained`` say,
    for each, whether it is evaluated and how many buffers its graph retains when it is not.

    ``keys``: each array's name across readings, ``(id of its cache, its steps from it)``;
    ``refs``: each cache's weak reference by id (None: not followed). ``walked``: the indices of
    the pending arrays whose graphs the sampler walked (None: all of them; the others are
    estimates). ``kept``: by root, whether it is a kept cache; ``kept_since`` the last forward of
    the newest of them. ``pending_nodes``, ``sampled``: the sampler's. ``parameters``: the model's
    parameter arrays. ``compiled``: the compiled functions' entries by site, ``(buffers, entries)``,
    resident always, and sites of the reading where ``compiled_sites`` (a probe's reading measures
    what the fix cuts: none of them). ``mlx_count``: MLX's own count, ``(live, cached)``, where it
    has one: what is resident. ``fixing``: the fix has run, and cuts what pending graphs retain;
    ``fixed_at``: the step of its last run."""
    by_cache: dict[int, _Cache] = {}
    sites: dict[str, SiteCount] = {}
    kept_buffers = kept_retained = 0.0
    kept_pending = 0
    for index, (f, key, done, held) in enumerate(zip(found, keys, evaluated, retained)):
        if kept[f.root]:
            if done:
                kept_buffers += 1
            else:
                kept_buffers += held
                kept_retained += held
                kept_pending += 1
        cache = by_cache.get(key[0])
        if cache is None:
            cache = by_cache[key[0]] = _Cache(refs.get(key[0]))
        site = sites.get(f.site)
        if site is None:
            site = sites[f.site] = SiteCount()
        site.add(key, cache.ref, f.path, done, held, walked is None or index in walked)
        if done:
            cache.buffers += 1
        else:
            cache.buffers += held
            cache.retained += held
    by_site = {name: site.tally() for name, site in sites.items()}

    cache_buffers = sum(evaluated)
    retained_buffers = sum(retained)
    pending_arrays = len(found) - cache_buffers
    # The compiled functions' cache entries (compiled.py): process-wide, held outside any cache.
    compiled_buffers = 0
    for compiled_site, (buffers, entries) in (compiled or {}).items():
        compiled_buffers += buffers
        if compiled_sites:
            by_site[compiled_site] = SiteTally(held=buffers, arrays=entries)
    mlx_cached = 0
    resident = total = parameters + cache_buffers + retained_buffers + compiled_buffers
    if mlx_count is not None:  # MLX's own count: live buffers grow, cached ones are reserved
        live, mlx_cached = mlx_count
        resident = total = float(live)
    sample = None
    if found:  # an empty cache is no sample of growth
        sample = total
        if fixing and mlx_count is None:
            # The fix cuts what pending graphs retain (a sawtooth of height fix_every x rate): the
            # growth to forecast is what it leaves behind, an evaluated buffer for each array.
            sample = total - retained_buffers + pending_arrays
            kept_buffers += kept_pending - kept_retained
    return Reading(
        step=step,
        resident=resident,
        cache_buffers=cache_buffers,
        retained=int(round(retained_buffers)),
        pending_nodes=int(round(pending_nodes)),
        sampled=sampled,
        by_cache=tuple(
            CacheTally(cache.ref, cache.buffers, cache.retained)
            for cache in by_cache.values()
            if cache.ref is not None
        ),
        mlx_cached=mlx_cached,
        pending_arrays=pending_arrays,
        fixed_at=fixed_at,
        by_site=types.MappingProxyType(by_site),
        walked=total,
        sample=sample,
        kept=kept_buffers if found else None,
        kept_since=kept_since,
    )
