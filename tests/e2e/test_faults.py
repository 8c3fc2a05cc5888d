"""Faults against a replica group electing its primary in etcd, judged by the history checker
(tests/helpers/history.py): every write a worker saw acknowledged is in the final state exactly
once, no write is applied twice, and every replica ends holding the same state.

Four workers (tests/helpers/writers.py: ``PSClient('a|b')`` on threads, following the primary)
push one-hot gradients and increment a counter without pause while, one at a time:

* the primary is killed (SIGKILL), then started again (empty: it catches up from the log);
* the primary is frozen (SIGSTOP) past its lease, then let go (SIGCONT): it comes back as a
  backup of the replica that took over;
* a backup is killed, the primary goes on without it, and it is started again and caught up;
* a seeded random schedule of these (the seed is printed; ``PARAMSHARD_FAULT_SEED`` replays
  one; ``PARAMSHARD_TEST_SCALE`` lengthens it).

The link cut (a primary unplugged from its backup, the workers and etcd, then plugged back in)
needs network namespaces: tests/e2e/test_faults_netns.py.

No test asserts a timing: a fault's effect is waited for (``eventually``) with generous bounds.
"""

from __future__ import annotations

import os
import random
import signal
import threading

import httpx2
import msgpack

from client_sdk import PSClient
from tests.conftest import examples
from tests.e2e.test_leadership import elected_group, one_primary, roles
from tests.helpers.eventually import eventually
from tests.helpers.history import History
from tests.helpers.replicas import Group, cluster
from tests.helpers.writers import Writers, create_variables, final_state

#: Acknowledged writes to wait for between faults (the workers make progress).
STEP = 15


def role(url: str) -> str | None:
    """A replica's role, or None when it does not answer (in time)."""
    try:
        return str(cluster(url)["role"])
    except OSError:
        return None


def progress(writers: Writers, n: int = STEP, what: str = "writes acknowledged") -> None:
    target = writers.acked() + n
    eventually(lambda: writers.acked() >= target, f"{n} more {what}", timeout=60)


def settled(group: Group) -> int:
    """Wait until exactly one replica is primary and the others its backups at its epoch,
    each eligible to take over (a former primary too: its log matched the new primary's, or
    its state was replaced by it, and the primary confirmed it); the primary."""

    seen: dict[int, dict] = {}

    def check() -> tuple[int] | None:
        nonlocal seen
        seen = roles(group)
        primaries = [r for r, v in seen.items() if v["role"] == "primary"]
        if len(seen) != group.n or len(primaries) != 1:
            return None
        p = primaries[0]
        if not all(v["eligible"] for v in seen.values()):
            return None
        for r, v in seen.items():
            if r != p and (v["role"], v["primary"], v["epoch"]) != (
                "backup",
                group.urls[p],
                seen[p]["epoch"],
            ):
                return None
        return (p,)

    try:
        return eventually(check, "one primary and its backups", timeout=30)[0]
    except AssertionError as exc:  # what each replica said last, and what it logged
        logs = "\n".join(f"-- replica {r}:\n{group.log_tail(r, 25)}" for r in range(group.n))
        raise AssertionError(f"{exc}\nroles: {seen}\n{logs}") from None


def check_replicas(
    group: Group,
    history: History,
    among: list[int] | None = None,
) -> int:
    """Wait until the group settles (one primary, its backups eligible and at its lsn), then
    check every replica's state against ``history`` and against each other; the primary."""
    among = list(range(group.n)) if among is None else among
    p = settled(group) if among == list(range(group.n)) else one_primary(group, among)[0]
    eventually(
        lambda: len({cluster(group.urls[r])["lsn"] for r in among}) == 1,
        "every replica at the primary's lsn",
        timeout=30,
    )
    states = {r: final_state(group.urls[r]) for r in among}
    v, counter = states[p]
    assert history.check(v, counter) == [], f"the primary's state: {history.check(v, counter)}"
    for r, (vr, cr) in states.items():
        problems = history.check(vr, cr)
        if cr != counter or not (vr == v).all():
            problems.append("its state differs from the primary's")
        assert problems == [], f"replica {r} ({'primary' if r == p else 'backup'}): {problems}"
    sent, acked = history.count("push")
    assert acked >= STEP // 2 and sent >= acked
    return p


def running(group: Group) -> tuple[int, Writers]:
    """The group's primary once elected, and the workers writing to the group, the primary
    listed first (a replica that stops answering while listed before the others must not keep
    the workers from finding the new primary)."""
    p, _ = one_primary(group)
    create_variables(group.urls[p])
    return p, Writers("|".join([group.urls[p], *group.urls[:p], *group.urls[p + 1 :]])).start()


def test_a_kill_of_the_primary_loses_no_acknowledged_write(tmp_path, etcd):
    group, _ = elected_group(tmp_path, etcd)
    try:
        p, writers = running(group)
        try:
            progress(writers)
            group.kill(p)
            progress(writers, what="writes acknowledged by the new primary")
            group.start(p)  # empty: fed the log by the new primary
            one_primary(group)
            progress(writers)
        finally:
            writers.stop()
        assert check_replicas(group, writers.history) == 1 - p
    finally:
        group.close()


def test_a_primary_frozen_past_its_lease_comes_back_as_a_backup_losing_nothing(tmp_path, etcd):
    group, _ = elected_group(tmp_path, etcd)
    try:
        p, writers = running(group)
        try:
            progress(writers)
            group.send(p, signal.SIGSTOP)
            try:
                eventually(
                    lambda: role(group.urls[1 - p]) == "primary",
                    "the backup taking over",
                    timeout=30,
                )
                progress(writers, what="writes acknowledged while the old primary is frozen")
            finally:
                group.send(p, signal.SIGCONT)
            progress(writers)
        finally:
            writers.stop()
        eventually(lambda: role(group.urls[p]) == "backup", "the old primary a backup", 30)
        assert check_replicas(group, writers.history) == 1 - p
    finally:
        group.close()


def test_a_backup_killed_is_caught_up_and_loses_nothing(tmp_path, etcd):
    group, _ = elected_group(tmp_path, etcd, 2, "--replica-timeout", "1")
    try:
        p, writers = running(group)
        try:
            progress(writers)
            group.kill(1 - p)
            progress(writers, what="writes acknowledged without the backup")
            group.start(1 - p)  # empty: fed the whole log by the primary
            one_primary(group)
            progress(writers)
        finally:
            writers.stop()
        assert check_replicas(group, writers.history) == p
    finally:
        group.close()


def _increment(url: str, worker: str, delta: int, timeout: float = 30.0) -> httpx2.Response:
    body = msgpack.packb({"name": "counter", "delta": delta, "worker_id": worker, "seq": 1})
    return httpx2.post(
        url + "/v1/increment",
        content=body,
        headers={"content-type": "application/msgpack"},
        timeout=timeout,
    )


def test_a_write_only_the_frozen_primary_applied_is_not_kept_when_it_rejoins(tmp_path, etcd):
    """The primary forwards a write (10) to its frozen backup, then applies another (100) that
    waits behind it (one batch in flight per backup), and is frozen past its lease itself. The
    backup resumes, applies the first, takes over and acknowledges a third write (1) at the
    lsn where the old primary holds the second. Once the old primary rejoins as a backup, it
    must hold the new primary's state (its own write replaced: a state has no undo) and may
    lead again: 11 on both."""
    group, _ = elected_group(tmp_path, etcd)
    try:
        p, _ = one_primary(group)
        b = 1 - p
        create_variables(group.urls[p])
        lsn = cluster(group.urls[p])["lsn"]
        group.send(b, signal.SIGSTOP)

        def unanswered(worker: str, delta: int) -> None:
            try:
                _increment(group.urls[p], worker, delta, timeout=5)
            except httpx2.HTTPError:
                pass  # never acknowledged: the primary was frozen before it could answer

        pending = [
            threading.Thread(target=unanswered, args=(w, d), daemon=True)
            for w, d in (("first", 10), ("lone", 100))
        ]
        try:
            for k, thread in enumerate(pending):  # each applied, its answer waiting for b
                thread.start()
                eventually(
                    lambda k=k: cluster(group.urls[p])["lsn"] == lsn + 1 + k, "a write applied"
                )
            group.send(p, signal.SIGSTOP)
        finally:
            group.send(b, signal.SIGCONT)
        try:
            eventually(lambda: role(group.urls[b]) == "primary", "the backup leading")
            with PSClient("|".join(group.urls), worker_id="acked", timeout=2) as ps:
                assert ps.increment("counter", 1) == 11
        finally:
            group.send(p, signal.SIGCONT)
        for thread in pending:
            thread.join(timeout=30)
        assert settled(group) == b  # the old primary a backup, eligible again
        eventually(
            lambda: final_state(group.urls[p])[1] == 11,
            "the old primary holding the new primary's state, not the write only it applied",
        )
        assert final_state(group.urls[b])[1] == 11
        info = cluster(group.urls[p])
        assert info["installed"] == 1  # its state replaced by the primary's
        assert info["lsn"] == cluster(group.urls[b])["lsn"]
    finally:
        group.close()


FAULTS = ("kill primary", "freeze primary", "kill backup")


def test_a_random_schedule_of_faults_loses_no_acknowledged_write(tmp_path, etcd):
    seed = int(os.environ.get("PARAMSHARD_FAULT_SEED") or random.randrange(1 << 32))
    rng = random.Random(seed)
    schedule = [rng.choice(FAULTS) for _ in range(examples(2))]
    print(f"fault schedule (PARAMSHARD_FAULT_SEED={seed}): {schedule}")
    group, _ = elected_group(tmp_path, etcd, 2, "--replica-timeout", "1")
    try:
        p, writers = running(group)
        try:
            for fault in schedule:
                progress(writers, rng.randrange(5, 2 * STEP))
                p, _ = one_primary(group)
                victim = p if fault.endswith("primary") else 1 - p
                if fault.startswith("kill"):
                    group.kill(victim)
                    progress(writers, what=f"writes acknowledged after {fault}")
                    group.start(victim)
                else:
                    group.send(victim, signal.SIGSTOP)
                    try:
                        eventually(
                            lambda v=victim: role(group.urls[1 - v]) == "primary",
                            "the backup taking over",
                            timeout=30,
                        )
                        progress(writers, what=f"writes acknowledged after {fault}")
                    finally:
                        group.send(victim, signal.SIGCONT)
                    settled(group)  # the old primary rejoined: it may take over again
            progress(writers)
        finally:
            writers.stop()
        check_replicas(group, writers.history)
    except BaseException:
        print(f"failed with PARAMSHARD_FAULT_SEED={seed}")
        raise
    finally:
        group.close()
