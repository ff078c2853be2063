"""The census: the program's own objects that hold pending arrays, outside the caches read.

The walk counts what hangs off the caches it is handed. A program may keep lazy arrays elsewhere:
a server's scheduler that keeps each step's output as ``self.history = mx.concatenate([...])`` or
``self.score = self.score + logits.max()``, never evaluated, holds one more buffer a step, and the
walk reads ``+0/step``. The process count (``process_count.py``) sees that growth, unnamed.

A census finds those objects from the garbage collector's view, in C where it can:

1. every ``mx.array`` of the process: an instance of a heap type refers to its class, and the
   collector sees that reference, so ``gc.get_referrers(mx.array)`` lists them in one pass
   (checked once; where it fails, ``gc.get_objects()`` picked by exact type, ``map``/``compress``:
   no ``isinstance``, which could read a ``__class__`` property);
2. of them, those still pending (``graph.is_evaluated``), less the arrays the walk found in the
   caches and those the census follows already, the young ones first (a chain rebound every step
   has a young head), at most ``MAX_TARGETS`` (``gc.get_referrers``'s cost grows with them);
3. ``gc.get_referrers`` of those: an instance holding one as an attribute is a *holder*; a list,
   tuple, set or dict holding one is looked up once more (its holder's attribute holds the
   container; on Python 3.10, or once it was asked for, an instance's ``__dict__`` is such a
   dict). Frames, closures, modules, classes, ``nn.Module`` items and the watchdog's own objects
   are no holders.

The attributes are read as the walk reads them (``objects.attributes``: by name, slots through
their descriptors; no property, ``__getattr__`` or ``__eq__`` of the program runs; classes are
compared by id). Each holder's attribute is a site ``outside:<module>.<Class>.<attribute>``, and is
followed from then on by weak reference to its holder (it keeps nothing alive): at every walk of
the watchdog its arrays (the attribute's array, or the arrays among the items of the container it
holds) are read again and counted as the caches' are (``sampling.Sampler``: a sample when the
chains are too long to walk whole), in the reading's sites and in what is resident. A site whose
chains the program cuts now and then is bounded (``growth.py``), as a cache's is.

A census costs two or three passes over the objects of the process in C (about 12 ms of CPU for
100,000 objects, 50 ms for a million, here), so it runs at a walk from ``FIRST_STEP`` on,
``MIN_STEPS`` apart at least, while the census's own time fits ``SHARE`` of the watchdog's budget
(the whole budget while the process count reads growth that no site explains). A new holder is
counted from the census that finds it; the readings before did not count it, so the watchdog reads
the growth afresh from there (``Census.fresh``), as when a holder dies.

What it misses is in docs/internals.md ("The census").
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import operator
import os
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from . import clock, objects
from .arrays import Found
from .graph import cpu_clock, is_evaluated
from .objects import ARRAY, DICT, OBJECT, SEQUENCE, SET, code_name, info
from .reading import SiteCount
from .sampling import Sampler
from .schedule import WALK_CREDIT_SECONDS

if TYPE_CHECKING:
    from .forecast import Leak
    from .schedule import Schedule

logger = logging.getLogger("mlx_watchdog")

PREFIX = "outside:"  # the site of a program object's attribute: "outside:pkg.module.Class.attribute"
ENV = "MLX_WATCHDOG_CENSUS"  # on, off or auto: what census="auto" does
SHARE = 0.25  # of the overhead budget, the census's own time at most
FIRST_STEP = 8  # the first census comes at a walk from this step on: a program's per-step state
# starts with its first token (mlx-lm's generate_step runs the next forward before it yields one)
MIN_STEPS = 16  # steps between two censuses, at least
MAX_TARGETS = 64  # pending arrays looked up in one census (gc.get_referrers: its cost grows with them)
MAX_OBJECTS = 5_000_000  # objects looked at where the collector cannot list the arrays alone
MAX_HOLDINGS = 256  # attributes followed at once
MAX_ITEMS = 4096  # items of a container attribute read for arrays; a bigger one is not read
MAX_ATTRIBUTES = 10_000  # attributes of one holder read
MAX_SITE_LEN = 120
# A census whose CPU time passes this stalls the program too long: no more censuses (the
# attributes already followed are still read at every walk).
MAX_CENSUS_SECONDS = 0.5
ADVICE = (
    "an attribute of the program's own object, outside the caches, keeps lazy arrays that grow "
    "every step; the fix evaluates caches only, never the program's objects: evaluate it where "
    "the program updates it (mx.eval, or mx.async_eval every step or every few), or keep it "
    "bounded (drop what it no longer needs)"
)
_WATCHDOG_PACKAGE = __name__.split(".")[0]  # its own objects hold arrays too: never holders

_type_dict = type.__dict__["__dict__"].__get__


def is_outside_site(site: str) -> bool:
    """Is ``site`` an attribute of a program object outside the caches (``outside:...``)?"""
    return site.startswith(PREFIX)


def advice(leaks: Iterable[Leak]) -> str | None:
    """What to do about the outside sites among the leaks (biggest first), or None."""
    sites = [leak.site for leak in leaks if is_outside_site(leak.site)]
    if not sites:
        return None
    return f"{', '.join(dict.fromkeys(sites))}: {ADVICE}"


def mode_off(mode: bool | str) -> str | None:
    """Why a census of this ``mode`` (``True``, ``False``, ``"auto"``: as ``$MLX_WATCHDOG_CENSUS``
    says, on unless it says off) is off, or None when it is on."""
    if mode is False:
        return "off (census=False)"
    if mode == "auto":
        setting = os.environ.get(ENV, "auto").strip().lower()
        if setting in ("off", "0", "false", "no"):
            return f"off ({ENV}={os.environ[ENV]})"
    return None


@dataclasses.dataclass(eq=False)
class Holding:
    """One attribute followed: its holder (by weak reference), how to read it, its site."""

    ref: weakref.ref
    step: Any  # the attribute's name, or its slot descriptor (objects.attribute)
    site: str
    path: str  # "<Scheduler#3>.history"
    serial: int  # names its arrays across readings (an id may be reused by another holder)
    holder: int  # names its holder in paths
    attribute: str  # the attribute's code name, or a placeholder (``<attr 3>``)


@dataclasses.dataclass(frozen=True)
class CensusReading:
    """The arrays of the attributes followed, counted at one walk."""

    buffers: float  # evaluated arrays, and the buffers the pending ones' graphs retain
    arrays: int
    pending: int


class Census:
    """One watchdog's census (see the module's docstring)."""

    def __init__(self, mode: bool | str = "auto") -> None:
        self.off = mode_off(mode)  # why no census runs (None while it does)
        # The attributes counted changed since the last reading (one followed from now on, or its
        # holder died): the readings before counted other arrays, so they are no points of the
        # growth of what is counted now (the watchdog reads the growth afresh from this reading).
        self.fresh = False
        self._fresh = False
        self._holdings: dict[tuple[int, Any], Holding] = {}
        self._serial = 0
        self._sampler = Sampler()
        self._next_step = FIRST_STEP
        # What the censuses cost and found (read by tests, benchmarks and docs).
        self.runs = 0
        self.seconds = 0.0  # wall time of every census (charged to the watchdog's budget)
        self.cpu_seconds = 0.0
        self.cost = 0.0  # the last census's wall time: what the next one is expected to cost
        self.read_seconds = 0.0  # wall time of the readings of the attributes followed, at the walks
        self.arrays = 0  # arrays of the process the last census looked at
        self.targets = 0  # pending arrays it looked up
        self.unreferenced = 0  # holders it found that take no weak reference: not followed
        self.errors = 0
        self.last: CensusReading = CensusReading(0.0, 0, 0)

    # ----------------------------------------------------------------- public

    @property
    def sites(self) -> list[str]:
        """The sites followed now."""
        return list(dict.fromkeys(h.site for h in self._holdings.copy().values()))

    def read(
        self,
        step: int,
        found: Sequence[Found],
        schedule: Schedule,
        sites: dict[str, SiteCount] | None,
        unexplained: float = 0.0,
    ) -> float:
        """At a walk of ``step`` that found ``found`` in the caches: a census first, when one is
        due and fits the budget (``unexplained``: the process count's growth that no site
        explains, which makes it first in the budget); then the buffers of the attributes
        followed, each site's count added to ``sites`` (None: a fix-mode probe's reading, whose
        sites are what the fix cuts: none of these). ``fresh`` says whether the attributes counted
        changed since the last reading. Never raises."""
        if self.off is None and sites is not None and self._due(step, schedule, unexplained):
            try:
                self._census(step, found)
            except Exception as exc:
                self._error("census", exc)
        self.fresh, self._fresh = self._fresh, False
        if not self._holdings:
            self.last = CensusReading(0.0, 0, 0)
            return 0.0
        started = clock.wall()
        try:
            return self._tally(step, found, sites)
        except Exception as exc:  # counted; the walk goes on without these buffers
            self._error("reading", exc)
            return 0.0
        finally:
            self.read_seconds += clock.wall() - started

    # ----------------------------------------------------------------- reading

    def owners(self) -> dict[str, tuple[type, str]]:
        """Each followed site's holder class and attribute, from a holder alive now: where a probe
        (``attribution.py``) can find the line that rebinds it."""
        out: dict[str, tuple[type, str]] = {}
        for holding in self._holdings.copy().values():
            holder = holding.ref()
            if holder is not None and holding.site not in out and code_name(holding.attribute):
                out[holding.site] = (type(holder), holding.attribute)
        return out

    def _tally(self, step: int, found: Sequence[Found], sites: dict[str, SiteCount] | None) -> float:
        """The buffers of the attributes followed, and their sites' tallies."""
        arrays, owners = self._followed_arrays({id(f.array) for f in found})
        if not arrays:
            self.last = CensusReading(0.0, 0, 0)
            return 0.0
        keys = [("outside", holding.serial, index) for holding, index in owners]
        reading = self._sampler.read(arrays, step, keys=keys)
        walked = reading.walked_indices
        buffers = float(reading.evaluated_arrays) + reading.retained_buffers
        self.last = CensusReading(buffers, len(arrays), reading.pending_arrays)
        if sites is not None:
            for i, (f, (holding, _), key) in enumerate(zip(arrays, owners, keys)):
                done, retained = reading.evaluated[i], reading.retained[i]
                tally = sites.get(f.site)
                if tally is None:
                    tally = sites[f.site] = SiteCount()
                tally.add(key, holding.ref, f.path, done, retained, walked is None or i in walked)
        del arrays, reading
        return buffers

    def _followed_arrays(self, cached: set[int]) -> tuple[list[Found], list[tuple[Holding, int | None]]]:
        """The arrays of the attributes followed now (not those in ``cached``, counted by the walk),
        each once, and for each its holding and its position in the attribute."""
        seen: set[int] = set()
        arrays: list[Found] = []
        owners: list[tuple[Holding, int | None]] = []
        for holding in self._holdings.copy().values():  # a copy: callbacks may remove entries
            holder = holding.ref()
            if holder is None:
                continue
            try:
                value = objects.attribute(holder, holding.step)
            except Exception:  # unset now, or unreadable: nothing there
                continue
            for index, array in _arrays_of(value):
                key = id(array)
                if key in seen or key in cached:
                    continue
                seen.add(key)
                path = holding.path if index is None else f"{holding.path}[{index}]"
                arrays.append(Found(path, holding.site, array, ()))
                owners.append((holding, index))
        return arrays, owners

    # ----------------------------------------------------------------- when

    def _due(self, step: int, schedule: Schedule, unexplained: float) -> bool:
        """From ``FIRST_STEP``, ``MIN_STEPS`` after the last census, while its time fits its share
        of the budget (as ``schedule.affordable`` counts it: the decode's time, the start-up credit
        as a floor), never past the budget as a whole."""
        if step < self._next_step or len(self._holdings) >= MAX_HOLDINGS:
            return False
        allowed = max(schedule.overhead_budget * schedule.decode_seconds, WALK_CREDIT_SECONDS)
        share = 1.0 if unexplained > 0 else SHARE
        return self.seconds + self.cost <= share * allowed and schedule.spent + self.cost <= allowed

    # ----------------------------------------------------------------- the census

    def _census(self, step: int, found: Sequence[Found]) -> None:
        started, cpu_started = clock.wall(), cpu_clock()
        try:
            added = self.discover(found)
        finally:
            cost = clock.wall() - started
            cpu = cpu_clock() - cpu_started
            self.runs += 1
            self.seconds += cost
            self.cpu_seconds += cpu
            self.cost = cost
            self._next_step = step + MIN_STEPS
        if cpu > MAX_CENSUS_SECONDS:
            self.off = (
                f"off: a census took {cpu:.2f} s of CPU ({self.arrays:,} arrays) "
                f"(more than {MAX_CENSUS_SECONDS} s stalls the program)"
            )
            logger.warning(
                "mlx-watchdog: the census is %s; the attributes it follows are still read", self.off
            )
        if added:
            self._fresh = True

    def discover(self, found: Sequence[Found]) -> int:
        """One census: the holders of pending arrays outside the caches. Returns how many
        attributes it began to follow."""
        exclude = {id(f.array) for f in found}
        followed, _ = self._followed_arrays(exclude)
        exclude.update(id(f.array) for f in followed)
        del followed
        targets = tuple(_pending_arrays(exclude, self))
        self.targets = len(targets)
        if not targets:
            return 0
        target_ids = {id(a) for a in targets}
        holders: list[tuple[Any, Any, str]] = []  # (holder, attribute step, attribute name)
        containers: list[Any] = []
        container_ids: dict[int, None] = {}
        referrers = gc.get_referrers(*targets)
        own = {id(targets), id(referrers)}
        for r in referrers:
            if id(r) in own:
                continue
            t = info(type(r))
            if t.kind == OBJECT:
                holders.extend(_holding_attributes(r, t, target_ids))
            elif t.kind in (DICT, SEQUENCE, SET) and not t.keys_are_names and len(containers) < MAX_TARGETS:
                if id(r) not in container_ids:
                    container_ids[id(r)] = None
                    containers.append(r)
        del referrers
        if containers:
            boxes = tuple(containers)
            referrers = gc.get_referrers(*boxes)
            own = {id(boxes), id(referrers), id(containers)}
            inside = set(container_ids) | target_ids
            for r in referrers:
                if id(r) in own:
                    continue
                t = info(type(r))
                if t.kind == OBJECT:
                    holders.extend(_holding_attributes(r, t, inside))
            del referrers, boxes
        del containers
        added = sum(self._follow(holder, step, name) for holder, step, name in holders)
        del holders, targets
        return added

    def _follow(self, holder: Any, step: Any, name: str) -> bool:
        key = (id(holder), step if type(step) is str else id(step))
        known = self._holdings.get(key)
        if known is not None and known.ref() is holder:
            return False
        if len(self._holdings) >= MAX_HOLDINGS:
            return False
        cls = type(holder)
        site = outside_site(cls, name)
        self._serial += 1
        try:
            ref = weakref.ref(holder, self._gone(key))
        except TypeError:  # takes no weak reference: following it would keep it alive
            self.unreferenced += 1
            return False
        # Its path names the holder by a number of its own, the same for each of its attributes.
        number = next((h.holder for h in self._holdings.copy().values() if h.ref() is holder), self._serial)
        path = f"<{info(cls).name}#{number}>.{name}"
        self._holdings[key] = Holding(ref, step, site, path, self._serial, number, name)
        return True

    def _gone(self, key: tuple[int, Any]) -> Callable[[weakref.ref], None]:
        def forget(ref: weakref.ref) -> None:  # may run on any thread, at any allocation
            holding = self._holdings.get(key)
            if holding is not None and holding.ref is ref:
                del self._holdings[key]
                self._fresh = True

        return forget

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors <= 3:
            logger.warning("mlx-watchdog: the census's %s failed: %r (the decode goes on)", where, exc)


# --------------------------------------------------------------------------- helpers


def outside_site(cls: type, attribute: str) -> str:
    """``outside:<module>.<Class>.<attribute>``, code names only (``objects.code_name``); a long
    module path keeps its last parts."""
    module = types.MappingProxyType.get(_type_dict(cls), "__module__", None)
    parts = module.split(".") if type(module) is str else []
    if not parts or not all(code_name(p) for p in parts):
        parts = ["<module>"]
    tail = f"{info(cls).name}.{attribute}"
    while len(parts) > 1 and len(PREFIX) + len(".".join(parts)) + 1 + len(tail) > MAX_SITE_LEN:
        parts = parts[1:]
    return f"{PREFIX}{'.'.join(parts)}.{tail}"[:MAX_SITE_LEN]


def _array_types() -> list[type]:
    """``mx.array`` and its subclasses, read in C (``type.__subclasses__``)."""
    out: list[type] = []
    stack: list[type] = [mx.array]
    while stack and len(out) < 256:
        cls = stack.pop()
        out.append(cls)
        stack.extend(type.__subclasses__(cls))
    return out


def _young_ids(kinds: tuple[type, ...]) -> set[int]:
    """Ids of the arrays in the collector's young generations (0 and 1: a few thousand objects at
    most), made since the last collections: a chain rebound at every step has a young head."""
    young: set[int] = set()
    ids = {id(k) for k in kinds}  # by id: comparing classes could run a metaclass's __eq__
    try:
        for generation in (0, 1):
            young.update(id(o) for o in gc.get_objects(generation=generation) if id(type(o)) in ids)
    except (TypeError, ValueError):  # a collector without those generations: no order
        pass
    return young


def _every_array(kinds: tuple[type, ...]) -> list[mx.array]:
    """Every array of the process, in the collector's order (its young generations first).

    An instance of a class made at run time (a heap type, as nanobind's ``mx.array`` is) refers
    to its class, and the collector sees that reference: ``gc.get_referrers`` of the array types
    lists every array in one pass in C. Where it does not (checked once, with an array made for
    it), every object the collector tracks is read instead (``gc.get_objects``), and the arrays
    picked among them by exact type in C: no ``isinstance``, which may read a ``__class__``
    property."""
    global _referrers_list_arrays
    ids = {id(k) for k in kinds}  # by id: comparing or hashing classes could run a metaclass's code
    probe = mx.array(0) if _referrers_list_arrays is None else None
    if _referrers_list_arrays is not False:
        held = gc.get_referrers(*kinds)
        if probe is not None:
            _referrers_list_arrays = any(o is probe for o in held)
        if _referrers_list_arrays:
            return [o for o in held if id(type(o)) in ids]
        del held
    everything = gc.get_objects()
    if len(everything) > MAX_OBJECTS:
        everything = everything[:MAX_OBJECTS]
    if len(kinds) == 1:
        chosen = map(operator.is_, map(type, everything), itertools.repeat(kinds[0]))
    else:
        chosen = map(ids.__contains__, map(id, map(type, everything)))
    return list(itertools.compress(everything, chosen))


_referrers_list_arrays: bool | None = None  # gc.get_referrers(mx.array) lists every array (None: not checked)


def _pending_arrays(exclude: set[int], census: Census) -> list[mx.array]:
    """Pending arrays of the process, not in ``exclude`` (by id), at most ``MAX_TARGETS``: the
    young ones first, then the others from the most recently promoted (a generation is merged at
    the end of the next)."""
    kinds = tuple(_array_types())
    young = _young_ids(kinds)
    arrays = _every_array(kinds)
    census.arrays = len(arrays)
    ordered = [a for a in arrays if id(a) in young]
    ordered += reversed([a for a in arrays if id(a) not in young])
    del arrays
    pending: list[mx.array] = []
    for array in ordered:
        if len(pending) >= MAX_TARGETS:
            break
        if id(array) in exclude or not objects.usable_array(array):
            continue
        try:
            if is_evaluated(array):
                continue
        except Exception:
            continue
        pending.append(array)
    return pending


def _holding_attributes(holder: Any, t: objects.TypeInfo, ids: set[int]) -> list[tuple[Any, Any, str]]:
    """(holder, attribute step, name) of each attribute of ``holder`` whose value is one of
    ``ids`` (a pending array, or a container holding one)."""
    if _own(t.cls):
        return []
    try:
        attrs = objects.attributes(holder, t, MAX_ATTRIBUTES)
    except Exception:
        return []
    out = []
    for position, (key, step, child) in enumerate(attrs or ()):
        if id(child) in ids:
            out.append((holder, step, code_name(key) or f"<attr {position}>"))
    return out


def _own(cls: type) -> bool:
    """A class of the watchdog's own package (its records hold the arrays it read)."""
    module = types.MappingProxyType.get(_type_dict(cls), "__module__", None)
    return type(module) is str and (module == _WATCHDOG_PACKAGE or module.startswith(_WATCHDOG_PACKAGE + "."))


def _arrays_of(value: Any) -> list[tuple[int | None, mx.array]]:
    """The arrays an attribute holds: itself (index None), or those among the items of the
    container it is (their positions), read through the builtin's own methods."""
    t = info(type(value))
    if t.kind == ARRAY:
        return [(None, value)] if objects.usable_array(value) else []
    if t.kind not in (SEQUENCE, SET, DICT) or t.keys_are_names or t.snapshot is None or t.length is None:
        return []
    if t.length(value) > MAX_ITEMS:
        return []
    items = t.snapshot(value)
    if t.kind == DICT:
        items = [v for _, v in items]
    return [
        (i, item)
        for i, item in enumerate(items)
        if info(type(item)).kind == ARRAY and objects.usable_array(item)
    ]
