"""Replicas in lock step: R interpreters (one thread each) that meet at every collective.

Every replica runs the same program on its own values (its rows of the host streams, its copy
of each variable). A collective op is where they meet: each replica posts its input and waits
until all ``R`` replicas have posted for the *same* op record; the collective then computes every
replica's output at once. Replicas that reach different collectives, or a replica that ends its
run while others wait at a collective, raise ``PopartError`` (on the device such a program
would deadlock or exchange garbage), never a hang. An exception in one replica aborts the
others.
"""
import threading

from .errors import PopartError


class _Aborted(Exception):
    """Raised in a replica waiting at a collective when another replica failed."""


class Rendezvous:
    """Where ``replicas`` threads meet at collectives.

    Args:
        replicas: number of replicas R.
    """

    def __init__(self, replicas):
        self.replicas = replicas
        self._cv = threading.Condition()
        self._posted = {}  # replica -> (op, value)
        self._results = None
        self._generation = 0
        self._done = set()
        self._failed = None

    def meet(self, replica, op, value, combine):
        """Post ``value`` for collective ``op`` and wait for every replica's.

        Args:
            replica: this replica's index. op: the op record (identity compared).
            value: this replica's input array. combine: fn([value per replica]) -> [output
                per replica], run once by the last replica to arrive.
        Returns:
            This replica's output.
        """
        if self.replicas == 1:
            return combine([value])[0]
        with self._cv:
            if self._failed is not None:
                raise _Aborted()
            gen = self._generation
            self._posted[replica] = (op, value)
            self._check_done()
            if len(self._posted) == self.replicas:
                self._complete(combine)
            else:
                while self._generation == gen and self._failed is None:
                    self._cv.wait()
                if self._failed is not None and self._generation == gen:
                    raise _Aborted()
            return self._results[gen % 2][replica]

    def _complete(self, combine):
        ops = {id(op): op for op, _ in self._posted.values()}
        if len(ops) != 1:
            names = sorted({f"{op.kind} #{op.index} in {op.graph.name}" for op in ops.values()})
            self._fail(PopartError(f"replicas reached different collectives at the same step "
                                   f"({', '.join(names)}): every replica must run the same "
                                   "sequence of collectives"))
            raise self._failed
        values = [self._posted[r][1] for r in range(self.replicas)]
        try:
            outputs = combine(values)
        except BaseException as exc:
            self._fail(exc)
            raise
        if self._results is None:
            self._results = [None, None]
        self._results[self._generation % 2] = outputs
        self._posted = {}
        self._generation += 1
        self._cv.notify_all()

    def _check_done(self):
        if self._done and self._posted:
            op = next(iter(self._posted.values()))[0]
            self._fail(PopartError(
                f"replica(s) {sorted(self._done)} finished the run while replica(s) "
                f"{sorted(self._posted)} wait at collective {op.kind} #{op.index} in "
                f"{op.graph.name}: every replica must run the same sequence of collectives"))
            raise self._failed

    def finish(self, replica):
        """Mark ``replica`` as done; fail any replica still waiting at a collective."""
        with self._cv:
            self._done.add(replica)
            if self._posted and self._failed is None:
                try:
                    self._check_done()
                except PopartError:
                    pass

    def _fail(self, exc):
        if self._failed is None:
            self._failed = exc
        self._cv.notify_all()

    def abort(self, exc):
        """Wake every waiting replica with ``exc`` as the run's failure."""
        with self._cv:
            self._fail(exc)


def run_replicas(replicas, body):
    """Run ``body(r)`` for r in range(replicas), each in its own thread, in lock step at
    collectives (see ``Rendezvous``).

    Args:
        replicas: R. body: fn(replica index, rendezvous) -> result.
    Returns:
        [result per replica]. Raises the first failure (a replica's exception, or the
        PopartError of replicas that diverged).
    """
    rdv = Rendezvous(replicas)
    if replicas == 1:
        return [body(0, rdv)]
    results, errors = [None] * replicas, [None] * replicas

    def target(r):
        try:
            results[r] = body(r, rdv)
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[r] = exc
            rdv.abort(exc)
        finally:
            rdv.finish(r)

    threads = [threading.Thread(target=target, args=(r,), name=f"replica-{r}")
               for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if rdv._failed is not None:
        raise rdv._failed
    for exc in errors:
        if exc is not None:
            raise exc
    return results
