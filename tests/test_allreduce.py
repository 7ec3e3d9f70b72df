"""Butterfly all-reduce over real hosts on 127.0.0.1: exact means, modes, compression, faults."""

import asyncio
import multiprocessing
import time

import pytest
import torch

from plexus.averaging.allreduce import AllReduceError, AllReduceRouter, AllReduceRunner, AveragingMode
from plexus.averaging.messages import PartHeader
from plexus.averaging.reducer_core import ReducerCore
from plexus.compression import Float16Compression
from plexus.p2p.host import Host
from plexus.p2p.identity import PeerID
from plexus.p2p.multiaddr import Multiaddr

NODE, CLIENT, AUX = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX
SHAPES = [(1,), (7, 3), (1001,), (33, 17), (5,)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run(coroutine, timeout):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def make_tensors(seed, shapes=SHAPES, dtypes=DTYPES):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=generator).mul_(seed + 1).to(dtype)
        for shape, dtype in zip(shapes, dtypes)
    ]


def weighted_mean(tensor_sets, weights):
    """The reference: the weighted mean in float64 of each tensor over the given peers."""
    total = sum(weights)
    return [
        sum(w * ts[i].double() for ts, w in zip(tensor_sets, weights)) / total
        for i in range(len(tensor_sets[0]))
    ]


def assert_close(got, expected):
    for g, e in zip(got, expected):
        tol = TOLERANCE[g.dtype]
        torch.testing.assert_close(g.double(), e.double(), rtol=tol, atol=tol * e.abs().max().item())


class Swarm:
    """n hosts on 127.0.0.1 that know each other's addresses, each with an all-reduce router."""

    def __init__(self, n: int, **router_options):
        self.n, self.router_options = n, router_options

    async def __aenter__(self):
        self.hosts = [await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start() for _ in range(self.n)]
        for a in self.hosts:
            for b in self.hosts:
                if a is not b:
                    a.add_addrs(b.peer_id, b.get_listen_maddrs())
        self.routers = [AllReduceRouter(h, **self.router_options) for h in self.hosts]
        self.peer_ids = [h.peer_id for h in self.hosts]
        return self

    async def __aexit__(self, *exc_info):
        await asyncio.gather(*(h.shutdown() for h in self.hosts))

    def runners(
        self,
        tensor_sets,
        fractions,
        modes=None,
        weights=None,
        group_id=b"group-1",
        only=None,
        outputs=None,
        **options,
    ):
        weights = weights or [1.0] * self.n
        return [
            AllReduceRunner(
                self.hosts[i],
                group_id,
                tensor_sets[i],
                self.peer_ids,
                fractions,
                modes,
                weight=weights[i],
                outputs=outputs and outputs[i],
                **options,
            )
            for i in (only if only is not None else range(self.n))
        ]

    async def run(self, runners):
        async def one(runner):
            with self.routers[self.hosts.index(runner.host)].register(runner):
                return await runner.run()

        return await asyncio.gather(*(one(r) for r in runners))


def results_of(tensor_sets, separate: bool):
    """Where each peer's results land: its tensors (in place), or NaN-filled outputs that every part
    must overwrite, with a result or with the local values."""
    if not separate:
        return tensor_sets, None
    outputs = [[torch.full_like(t, float("nan")) for t in ts] for ts in tensor_sets]
    return outputs, outputs


def assert_untouched(tensor_sets, originals, separate: bool) -> None:
    if separate:  # with outputs, the tensors are only read
        for ts, os in zip(tensor_sets, originals):
            assert all(torch.equal(t, o) for t, o in zip(ts, os))


# --- the core, on virtual time -------------------------------------------------------------------


def test_core_frontier_window_and_stall_clock():
    core = ReducerCore(5, [0, 1, 2], window=2, sender_timeout=1.0, now=0.0, exempt=[0])
    assert core.next_deadline() == 1.0 and core.expired(0.5) == []
    assert not core.open(1, 0.0) and core.open(2, 0.0)
    assert core.contribute(0, 0, 0.1) == range(0) and core.contribute(0, 1, 0.1) == range(0)
    assert not core.allowed(0)  # two parts ahead of the frontier: held back, no clock
    assert core.contribute(1, 0, 0.2) == range(0)
    assert core.contribute(2, 0, 0.3) == range(0, 1)
    assert core.allowed(0) and core.next_deadline() == pytest.approx(1.2)
    with pytest.raises(ValueError, match="expected part 1"):
        core.contribute(1, 3, 0.4)
    assert core.expired(1.25) == [1]
    assert core.exclude(1, "stalled", 1.25) == range(0)  # sender 2 still owes part 1
    assert core.contribute(2, 1, 1.3) == range(1, 2)
    assert core.exclude(2, "gone", 1.4) == range(2, 2)  # the local sender owes part 2 now
    for index in range(2, 5):
        core.contribute(0, index, 1.5)
    assert core.done and core.excluded == {1: "stalled", 2: "gone"} and core.next_deadline() is None
    with pytest.raises(ValueError, match="not a live sender"):
        core.contribute(1, 1, 2.0)


def test_core_waits_for_every_stream_before_any_part_and_restarts_the_clocks():
    core = ReducerCore(4, [0, 1, 2], window=2, sender_timeout=1.0, now=0.0, exempt=[0])
    assert not core.settled and not core.allowed(0)
    with pytest.raises(ValueError, match="before every sender opened"):
        core.contribute(0, 0, 0.1)
    assert not core.open(1, 0.5)
    assert core.expired(1.2) == [2]  # sender 1 waits for the others: only the missing stream owes
    core.exclude(2, "never came", 1.2)
    assert core.settled and core.allowed(0) and core.allowed(1)
    assert core.next_deadline() == pytest.approx(2.2)  # sender 1's clock starts when the weights settle
    with pytest.raises(ValueError, match="not a live sender that has yet to open"):
        core.open(1, 1.3)


def test_core_excluding_everyone_completes_the_span():
    core = ReducerCore(3, [1, 2], window=1, sender_timeout=1.0, now=0.0)
    core.open(1, 0.0)
    core.open(2, 0.0)
    core.contribute(1, 0, 0.5)
    assert core.exclude(2, "x", 1.0) == range(0, 1)
    assert core.exclude(1, "y", 1.0) == range(1, 3) and core.done


# --- exact averages ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.timeout(60)
def test_exact_weighted_average_with_uneven_spans_and_many_parts(n):
    async def main():
        async with Swarm(n) as swarm:
            tensor_sets = [make_tensors(seed) for seed in range(n)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            weights = [1.0 + 0.5 * i for i in range(n)]
            fractions = [i + 1 for i in range(n)]
            runners = swarm.runners(
                tensor_sets,
                fractions,
                weights=weights,
                part_size_bytes=256,
                sender_timeout=10,
                reducer_timeout=20,
            )
            assert sum(r.num_parts for r in runners) > 3 * n  # many parts per span
            reports = await swarm.run(runners)
            assert all(report.complete for report in reports)
            expected = weighted_mean(originals, weights)
            for ts in tensor_sets:
                assert_close(ts, expected)
                for t, first in zip(ts, tensor_sets[0]):
                    assert torch.equal(t, first)  # bit-identical on every peer

    run(main(), 50)


@pytest.mark.parametrize("separate_outputs", [False, True])
@pytest.mark.timeout(30)
def test_client_and_aux_modes_and_alpha(separate_outputs):
    async def main():
        async with Swarm(4) as swarm:
            tensor_sets = [make_tensors(seed) for seed in range(4)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            results, outputs = results_of(tensor_sets, separate_outputs)
            modes, weights = [NODE, CLIENT, AUX, NODE], [1.0, 3.0, 5.0, 2.0]
            runners = swarm.runners(
                tensor_sets,
                [1, 0, 2, 1],
                modes,
                weights,
                part_size_bytes=512,
                averaging_alpha=0.5,
                outputs=outputs,
            )
            assert runners[1].num_parts == 0 and runners[2].weight == 0.0
            reports = await swarm.run(runners)
            assert all(report.complete for report in reports)
            mean = weighted_mean([originals[0], originals[1], originals[3]], [1.0, 3.0, 2.0])
            for i in (0, 1, 3):
                assert_close(
                    results[i], [x.double() + 0.5 * (m - x.double()) for x, m in zip(originals[i], mean)]
                )
            for t, o in zip(results[2], originals[2]):
                assert torch.equal(t, o)  # AUX tensors are left alone
            assert_untouched(tensor_sets, originals, separate_outputs)

    run(main(), 25)


@pytest.mark.parametrize("separate_outputs", [False, True])
@pytest.mark.timeout(30)
def test_float16_compression_within_its_error_bound(separate_outputs):
    """Float16 parts and deltas: each rounding is within 2**-11 relative, so the result is within
    2**-11 * (|x| + max|x| + |delta|) <= 2**-9 * max|x| of the exact mean."""

    async def main():
        async with Swarm(3) as swarm:
            float32 = [torch.float32] * len(SHAPES)
            tensor_sets = [make_tensors(seed, dtypes=float32) for seed in range(3)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            results, outputs = results_of(tensor_sets, separate_outputs)
            runners = swarm.runners(
                tensor_sets, [1, 1, 1], compression=Float16Compression(), part_size_bytes=600, outputs=outputs
            )
            sizes = {p.numel for r in range(3) for p in runners[0].partition.parts(r) if p.tensor_index == 2}
            assert max(sizes) == 300  # 600 wire bytes of float16: parts are sized after compression
            reports = await swarm.run(runners)
            assert all(report.complete for report in reports)
            expected = weighted_mean(originals, [1, 1, 1])
            scale = max(t.abs().max().item() for ts in originals for t in ts)
            for ts in results:
                for got, exact in zip(ts, expected):
                    error = (got.double() - exact).abs().max().item()
                    assert error <= 2**-9 * scale
                    assert error > 0 or got.numel() == 1  # it really was compressed
            assert_untouched(tensor_sets, originals, separate_outputs)

    run(main(), 25)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("separate_outputs", [False, True])
def test_zero_total_weight_keeps_local_values(separate_outputs):
    async def main():
        async with Swarm(3) as swarm:
            tensor_sets = [make_tensors(seed) for seed in range(3)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            results, outputs = results_of(tensor_sets, separate_outputs)
            reports = await swarm.run(
                swarm.runners(tensor_sets, [1, 1, 1], weights=[0.0] * 3, part_size_bytes=512, outputs=outputs)
            )
            assert all(report.complete for report in reports)
            for ts, os in zip(results, originals):
                assert all(torch.equal(t, o) for t, o in zip(ts, os))
            assert_untouched(tensor_sets, originals, separate_outputs)

    run(main(), 25)


# --- faults --------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_client_that_never_sends_is_excluded_and_the_rest_average():
    async def main():
        async with Swarm(3) as swarm:
            tensor_sets = [make_tensors(seed) for seed in range(3)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            runners = swarm.runners(
                tensor_sets,
                [1, 1, 0],
                [NODE, NODE, CLIENT],
                only=[0, 1],
                part_size_bytes=512,
                sender_timeout=0.5,
                reducer_timeout=3,
            )
            started = time.monotonic()
            reports = await swarm.run(runners)
            assert time.monotonic() - started < 3
            silent = swarm.peer_ids[2]
            for report in reports:
                assert (
                    not report.failed_spans and "did not open its stream" in report.excluded_senders[silent]
                )
            expected = weighted_mean(originals[:2], [1, 1])
            assert_close(tensor_sets[0], expected)
            assert_close(tensor_sets[1], expected)

    run(main(), 25)


@pytest.mark.parametrize("separate_outputs", [False, True])
@pytest.mark.timeout(30)
def test_a_silent_reducer_fails_its_span_and_the_others_keep_local_values_there(separate_outputs):
    async def main():
        async with Swarm(3, registration_timeout=5) as swarm:
            float32 = [torch.float32] * len(SHAPES)
            tensor_sets = [make_tensors(seed, dtypes=float32) for seed in range(3)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            results, outputs = results_of(tensor_sets, separate_outputs)
            runners = swarm.runners(
                tensor_sets,
                [1, 1, 1],
                only=[0, 1],
                part_size_bytes=512,
                sender_timeout=0.4,
                reducer_timeout=1.0,
                outputs=outputs,
            )
            started = time.monotonic()
            reports = await swarm.run(runners)
            assert time.monotonic() - started < 4
            for report in reports:
                (failure,) = report.failed_spans
                assert failure.reducer == swarm.peer_ids[2] and failure.parts_received == 0
                assert "reducer_timeout" in failure.reason
            expected = weighted_mean(originals[:2], [1, 1])
            partition = runners[0].partition
            for i in (0, 1):
                for reducer in range(3):
                    for part in partition.parts(reducer):
                        got = results[i][part.tensor_index].view(-1)[part.start : part.stop]
                        want = (
                            expected[part.tensor_index].view(-1)
                            if reducer < 2
                            else originals[i][part.tensor_index].view(-1)
                        )[part.start : part.stop]
                        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)

    run(main(), 25)


def stall_after(runner: AllReduceRunner, parts: int) -> None:
    """Make `runner` send `parts` parts to each reducer, then go quiet (its stream stays open)."""
    original = runner._part_frames

    async def frames(j):
        count = 0
        async for frame in original(j):
            if count == 2 * parts:
                await asyncio.Event().wait()
            count += 1
            yield frame

    runner._part_frames = frames


@pytest.mark.timeout(30)
def test_a_sender_that_stalls_mid_span_is_excluded_from_later_parts_only():
    async def main():
        async with Swarm(3) as swarm:
            float32 = [torch.float32] * len(SHAPES)
            tensor_sets = [make_tensors(seed, dtypes=float32) for seed in range(3)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            runners = swarm.runners(
                tensor_sets, [1, 1, 1], part_size_bytes=512, sender_timeout=0.5, reducer_timeout=1.5
            )
            stall_after(runners[2], 2)
            reports = await swarm.run(runners)
            staller = swarm.peer_ids[2]
            for report in reports[:2]:
                assert "sent no part" in report.excluded_senders[staller] and not report.failed_spans
            assert {f.reducer for f in reports[2].failed_spans} == set(swarm.peer_ids[:2])
            assert all("excluded you" in f.reason and f.parts_received == 2 for f in reports[2].failed_spans)
            everyone, survivors = weighted_mean(originals, [1, 1, 1]), weighted_mean(originals[:2], [1, 1])
            partition = runners[0].partition
            for i in range(3):
                for reducer in range(3):
                    for part in partition.parts(reducer):
                        if reducer == 2 or part.index < 2:
                            source = everyone  # the staller contributed these parts (or reduces them)
                        elif i == 2:
                            source = originals[2]  # it got no answer: local values
                        else:
                            source = survivors
                        got = tensor_sets[i][part.tensor_index].view(-1)[part.start : part.stop]
                        want = source[part.tensor_index].view(-1)[part.start : part.stop]
                        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)

    run(main(), 25)


@pytest.mark.timeout(40)
def test_a_peer_whose_host_dies_mid_round_leaves_each_part_averaged_or_local():
    """Rule: on every survivor, each part is either the average over the senders that contributed
    it (identical on every survivor that has it) or that survivor's local value; within a span the
    averaged parts come first."""

    async def main():
        async with Swarm(4) as swarm:
            shapes, float32 = [(40_000,), (30_001,)], [torch.float32] * 2
            tensor_sets = [make_tensors(seed, shapes, float32) for seed in range(4)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            runners = swarm.runners(
                tensor_sets,
                [1, 1, 1, 1],
                part_size_bytes=4096,
                sender_timeout=0.5,
                reducer_timeout=1.5,
                window=2,
            )
            victim = runners[3]
            answered = asyncio.Event()
            original_apply = victim._apply_answer

            def apply_and_signal(part, header, buffer):
                original_apply(part, header, buffer)
                if part.index >= 3:
                    answered.set()

            victim._apply_answer = apply_and_signal

            async def kill():
                await answered.wait()
                await swarm.hosts[3].shutdown()

            started = time.monotonic()
            results = await asyncio.gather(swarm.run(runners[:3]), kill(), swarm.run([victim]))
            assert time.monotonic() - started < 6
            reports = results[0]
            dead = swarm.peer_ids[3]
            assert any(dead in r.excluded_senders or r.failed_spans for r in reports)
            everyone, survivors = weighted_mean(originals, [1] * 4), weighted_mean(originals[:3], [1] * 3)
            partition = runners[0].partition
            for reducer in range(4):
                averaged_prefix = [True] * 3
                for part in partition.parts(reducer):
                    values = []
                    for i in range(3):
                        got = tensor_sets[i][part.tensor_index].view(-1)[part.start : part.stop].double()
                        local = originals[i][part.tensor_index].view(-1)[part.start : part.stop].double()
                        candidates = [
                            s[part.tensor_index].view(-1)[part.start : part.stop]
                            for s in (everyone, survivors)
                        ]
                        if torch.allclose(got, local, rtol=0, atol=0):
                            averaged_prefix[i] = False
                            continue
                        assert averaged_prefix[i], (
                            f"peer {i} has an averaged part after a local one in span {reducer}"
                        )
                        assert any(torch.allclose(got, c, rtol=1e-5, atol=1e-5) for c in candidates)
                        values.append(got)
                    assert all(torch.equal(v, values[0]) for v in values)  # the same average everywhere
                if reducer < 3:
                    assert all(averaged_prefix), "a live reducer's span must end fully averaged"

    run(main(), 35)


@pytest.mark.parametrize(
    "garbage", ["wrong size", "bad buffer", "bad first header", "bad later header", "nan"]
)
@pytest.mark.timeout(30)
def test_garbage_from_one_sender_excludes_it_and_leaves_the_others_exact(garbage):
    async def main():
        async with Swarm(3) as swarm:
            float32 = [torch.float32] * len(SHAPES)
            tensor_sets = [make_tensors(seed, dtypes=float32) for seed in range(3)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            runners = swarm.runners(
                tensor_sets,
                [1, 1, 1],
                part_size_bytes=512,
                reject_nonfinite=True,
                sender_timeout=1.0,
                reducer_timeout=2.0,
            )
            cheat, first_bad = runners[2], 1 if garbage == "bad later header" else 0
            honest = cheat._part_frames
            if garbage == "nan":
                for j in (0, 1):  # poison the first part it sends to each reducer
                    cheat.partition.view(cheat.partition.part(j, 0))[0] = float("nan")
            else:

                async def frames(j):
                    count = 0
                    async for frame in honest(j):
                        if count == 2 * first_bad:
                            break
                        count += 1
                        yield frame
                    part = cheat.partition.part(j, first_bad)
                    header = PartHeader(
                        part.index,
                        part.numel + (garbage == "wrong size"),
                        "float32",
                        0,
                        cheat.group_id if first_bad == 0 else None,
                        1.0 if first_bad == 0 else None,
                    )
                    yield b"\xc1\x00garbage" if "header" in garbage else header.encode()
                    yield b"\x00" * (4 * part.numel - (garbage == "bad buffer"))

                cheat._part_frames = frames
            reports = await swarm.run(runners)
            reasons = {
                "wrong size": "expected",
                "bad buffer": "does not match",
                "bad later header": "not valid msgpack",
                "bad first header": "did not open its stream",
                "nan": "NaN or inf",
            }
            for report in reports[:2]:
                assert reasons[garbage] in report.excluded_senders[swarm.peer_ids[2]]
                assert not report.failed_spans
            assert len(reports[2].failed_spans) == 2
            for failure in reports[2].failed_spans:  # the cheat is told why
                assert (
                    "not valid msgpack" if garbage == "bad first header" else "excluded you"
                ) in failure.reason
            everyone, survivors = weighted_mean(originals, [1, 1, 1]), weighted_mean(originals[:2], [1, 1])
            partition = runners[0].partition
            for i in (0, 1):
                for reducer in (0, 1):
                    for part in partition.parts(reducer):
                        got = tensor_sets[i][part.tensor_index].view(-1)[part.start : part.stop]
                        source = everyone if part.index < first_bad else survivors
                        want = source[part.tensor_index].view(-1)[part.start : part.stop]
                        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)

    run(main(), 25)


def test_an_answer_of_the_wrong_size_fails_that_span_and_writes_nothing():
    """Averages are copied straight from the received chunks into the tensor: a reducer whose
    answer is 4 bytes short must fail its span, leaving this peer's values there untouched."""

    async def main():
        async with Swarm(2) as swarm:
            tensor_sets = [[torch.randn(4096, generator=torch.Generator().manual_seed(i))] for i in range(2)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            runners = swarm.runners(tensor_sets, [1, 1], part_size_bytes=4096)  # 2 parts of 1024 per span
            liar, serve = runners[1], runners[1].serve_sender

            async def short_first_answer(stream, first, frames):
                count = 0
                async for frame in serve(stream, first, frames):
                    count += 1
                    yield frame[:-4] if count == 2 else frame  # frame 2: the first answer's buffer

            liar.serve_sender = short_first_answer
            reports = await swarm.run(runners)
            (failure,) = reports[0].failed_spans
            assert failure.parts_received == 0 and "4096 bytes" in failure.reason
            assert torch.equal(tensor_sets[0][0][2048:], originals[0][0][2048:])
            mean = (originals[0][0] + originals[1][0]) / 2
            assert torch.allclose(tensor_sets[0][0][:2048], mean[:2048])

    run(main(), 20)


def test_configuration_errors_say_what_to_fix():
    async def main():
        async with Swarm(2) as swarm:
            tensors = make_tensors(0)
            with pytest.raises(AllReduceError, match="clients reduce nothing"):
                swarm.runners([tensors, tensors], [1, 1], [NODE, CLIENT])
            with pytest.raises(AllReduceError, match="sender_timeout"):
                swarm.runners([tensors, tensors], [1, 1], sender_timeout=5, reducer_timeout=5)
            with pytest.raises(AllReduceError, match="not in the group"):
                AllReduceRunner(swarm.hosts[0], b"g", tensors, swarm.peer_ids[1:], [1])
            (runner,) = swarm.runners([tensors, tensors], [1, 1], only=[0])
            with swarm.routers[0].register(runner):
                with pytest.raises(AllReduceError, match="already has a runner"):
                    with swarm.routers[0].register(runner):
                        pass

    run(main(), 10)


# --- separate processes --------------------------------------------------------------------------


def _process_peer(index, n, connection, shapes):
    async def main():
        host = await Host(host_maddrs=("/ip4/127.0.0.1/tcp/0",)).start()
        router = AllReduceRouter(host)
        connection.send((host.peer_id.to_bytes(), [str(a) for a in host.get_listen_maddrs()]))
        peers = connection.recv()
        peer_ids = [PeerID(raw) for raw, _ in peers]
        for peer_id, (_, addrs) in zip(peer_ids, peers):
            if peer_id != host.peer_id:
                host.add_addrs(peer_id, [Multiaddr(a) for a in addrs])
        tensors = make_tensors(index, shapes, [torch.float32] * len(shapes))
        runner = AllReduceRunner(
            host,
            b"processes",
            tensors,
            peer_ids,
            [1] * n,
            weight=index + 1.0,
            sender_timeout=5,
            reducer_timeout=10,
        )
        started = time.perf_counter()
        with router.register(runner):
            report = await runner.run()
        elapsed = time.perf_counter() - started
        await host.shutdown()
        return report.complete, [t.numpy() for t in tensors], elapsed  # numpy: torch would pass fds

    connection.send(asyncio.run(main()))


def run_in_processes(n, shapes, timeout):
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(n)]
    processes = [
        context.Process(target=_process_peer, args=(i, n, pipes[i][1], shapes), daemon=True) for i in range(n)
    ]
    for process in processes:
        process.start()
    try:
        deadline = time.monotonic() + timeout
        peers = []
        for parent, _ in pipes:
            assert parent.poll(max(0.0, deadline - time.monotonic())), "a peer process did not start in time"
            peers.append(parent.recv())
        for parent, _ in pipes:
            parent.send(peers)
        results = []
        for parent, _ in pipes:
            assert parent.poll(max(0.0, deadline - time.monotonic())), "a peer process did not finish in time"
            results.append(parent.recv())
        return results
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_peers_in_separate_processes_average_exactly():
    shapes = [(100_003,), (64, 129)]
    results = run_in_processes(3, shapes, timeout=50)
    originals = [make_tensors(i, shapes, [torch.float32] * 2) for i in range(3)]
    expected = weighted_mean(originals, [1.0, 2.0, 3.0])
    for complete, arrays, _ in results:
        assert complete
        assert_close([torch.from_numpy(a) for a in arrays], expected)
