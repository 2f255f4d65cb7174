"""Building a trainer rank's workers from factories: what a factory must build, and the parallel state
its worker class needs, set up once per build and torn down before the next.

A factory is a picklable zero-argument callable that builds an
:class:`~integrations.rl.workers.base.RLWorkerMixin` on the rank that calls it: the tiny FSDP2 worker,
the Hugging Face worker, a Megatron worker or your own. Anything else is refused with
:class:`~dataplane.InvalidArgument`, on the driver already where the factory tells its class
(:func:`worker_class`), else on the rank once it has built it.

Some stacks need process groups set up before any model is built: Megatron-Core's ``parallel_state``
(TP, PP and DP groups from the rank layout). :class:`ParallelStates` runs each worker class's
:meth:`~integrations.rl.workers.base.RLWorkerMixin.setup_parallel_state` once per build (a policy, its
reference and its critic on the same stack share one), and the matching ``teardown_parallel_state``
before the next build.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dataplane import InvalidArgument
from integrations.rl.workers.base import RLWorkerMixin
from integrations.rl.workers.layout import RankLayout

__all__ = ["ParallelStates", "WorkerFactory", "check_factories", "check_worker", "worker_class"]

WorkerFactory = Callable[[], RLWorkerMixin]

_WHAT_IT_NEEDS = (
    "a trainer rank builds RLWorkerMixin workers: give a factory (a picklable zero-argument callable) that "
    "returns a DTensorRLWorkerMixin (FSDP2 / DTensor models, e.g. TinyDTensorWorker or HFCausalLMWorker), a "
    "MegatronRLWorkerMixin (Megatron-Core models, e.g. TinyMegatronWorker) or your own RLWorkerMixin subclass"
)


def worker_class(factory: Callable[[], Any]) -> type | None:
    """The class ``factory`` builds, where that can be told before calling it: the factory itself when
    it is a class, the class under a ``functools.partial`` (nested ones too), or the factory's
    ``worker_class`` attribute; None for any other callable (a lambda, a function).

    The trainer actor sets up what the class needs (Megatron's ``parallel_state``) before any model is
    built, so give a Megatron worker as its class or a partial of it, or set ``worker_class`` on your
    factory.

    >>> class W: ...
    >>> worker_class(functools.partial(W)) is W, worker_class(lambda: W())
    (True, None)
    """
    for _ in range(32):
        if not isinstance(factory, functools.partial):
            break
        factory = factory.func
    if isinstance(factory, type):
        return factory
    declared = getattr(factory, "worker_class", None)
    return declared if isinstance(declared, type) else None


def check_factories(factories: Mapping[str, Any]) -> dict[str, type | None]:
    """Each factory's worker class (None where it cannot be told before building), or
    :class:`~dataplane.InvalidArgument` for a mapping without ``"policy"``, a factory that is not
    callable, or one whose class is not an :class:`~integrations.rl.workers.base.RLWorkerMixin`.

    >>> from integrations.rl.workers.tiny import TinyDTensorWorker
    >>> check_factories({"policy": TinyDTensorWorker})
    {'policy': <class 'integrations.rl.workers.tiny.TinyDTensorWorker'>}
    >>> try:
    ...     check_factories({"policy": dict})
    ... except InvalidArgument as e:
    ...     print(str(e).split(";")[0])
    factory 'policy' builds a dict, not an RLWorkerMixin
    """
    if not isinstance(factories, Mapping):
        raise InvalidArgument(f"factories must be a mapping of model name to factory, got {type(factories).__name__}")
    if "policy" not in factories:
        raise InvalidArgument(f"factories need a 'policy' worker, got {sorted(factories)}")
    out: dict[str, type | None] = {}
    for name, factory in factories.items():
        if not callable(factory):
            raise InvalidArgument(f"factory {name!r} is a {type(factory).__name__}, not callable; {_WHAT_IT_NEEDS}")
        cls = worker_class(factory)
        if cls is not None and not issubclass(cls, RLWorkerMixin):
            raise InvalidArgument(f"factory {name!r} builds a {cls.__name__}, not an RLWorkerMixin; {_WHAT_IT_NEEDS}")
        out[name] = cls
    return out


def check_worker(name: str, worker: Any) -> RLWorkerMixin:
    """``worker`` if it is an :class:`~integrations.rl.workers.base.RLWorkerMixin`, else
    :class:`~dataplane.InvalidArgument` naming what was built and what is needed."""
    if not isinstance(worker, RLWorkerMixin):
        raise InvalidArgument(
            f"factory {name!r} built a {type(worker).__name__}, not an RLWorkerMixin; {_WHAT_IT_NEEDS}"
        )
    return worker


_NO_SETUP = RLWorkerMixin.setup_parallel_state.__func__  # type: ignore[attr-defined]


class ParallelStates:
    """The parallel-state hooks one rank has set up for its current workers.

    :meth:`setup` runs each distinct :meth:`~integrations.rl.workers.base.RLWorkerMixin.setup_parallel_state`
    of the given classes once; :meth:`teardown` runs their ``teardown_parallel_state`` (newest first)
    and frees the device memory the old models held. Every rank of the group calls both, together.
    """

    def __init__(self) -> None:
        self._done: list[type[RLWorkerMixin]] = []

    @property
    def classes(self) -> list[str]:
        """The classes whose own hooks are set up now (a name each; FSDP2 workers, which need none, are not)."""
        return [cls.__name__ for cls in self._done]

    def setup(self, classes: list[type | None], layout: RankLayout) -> None:
        """Run the set-up hook of each distinct class in ``classes`` (None: a factory that cannot tell;
        its worker sets up whatever it needs itself)."""
        hooks: set[Any] = {_NO_SETUP}  # the default hook does nothing: a class that keeps it is not listed
        for cls in classes:
            if cls is None or not issubclass(cls, RLWorkerMixin):
                continue
            hook = getattr(cls.setup_parallel_state, "__func__", cls.setup_parallel_state)
            if hook in hooks:
                continue
            hooks.add(hook)
            cls.setup_parallel_state(layout)
            self._done.append(cls)

    def teardown(self) -> None:
        """Tear down what :meth:`setup` set up (each distinct hook once, newest first)."""
        done, self._done = self._done, []
        gc.collect()  # the old models' parameters and groups go before the state they were built on
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
        hooks: set[Any] = set()
        for cls in reversed(done):
            hook = getattr(cls.teardown_parallel_state, "__func__", cls.teardown_parallel_state)
            if hook not in hooks:
                hooks.add(hook)
                cls.teardown_parallel_state()
