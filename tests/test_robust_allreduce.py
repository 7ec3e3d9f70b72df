"""One bad member in a butterfly all-reduce on 127.0.0.1: non-finite parts, huge or flipped values,
giant weights, and a reducer that answers wrongly. Faulty members are runners that override the
documented seams `outgoing` (what they send) and `reduced` (what they answer)."""

import asyncio

import pytest
import torch

from plexus.averaging.aggregation import RobustAggregation
from plexus.averaging.allreduce import AllReduceRunner, AveragingMode
from plexus.compression import Float16Compression, NoCompression
from tests.test_allreduce import Swarm, run, weighted_mean

pytestmark = pytest.mark.timeout(60)
NODE, CLIENT, AUX = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX
SHAPES = [(2000,), (33, 17), (40,), (9,)]  # the small ones make parts below 64 elements
ROBUST = RobustAggregation()


def tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) + 1.0).to(dtype) for shape in SHAPES]


class Attacker(AllReduceRunner):
    """Sends `attack(values)` instead of its values."""

    attack = staticmethod(lambda values: values)

    def outgoing(self, part, values):
        return self.attack(values.clone())


class WrongReducer(AllReduceRunner):
    """Answers every part of its span with the average plus 0.5."""

    def reduced(self, part, average):
        return average + 0.5


def nan_few(values):
    values[:2] = float("nan")
    return values


ATTACKS = {
    "nan_whole": lambda values: values.fill_(float("nan")),
    "nan_few": nan_few,
    "inf": lambda values: values.fill_(float("inf")),
    "scaled_1e3": lambda values: values * 1e3,
    "scaled_1e30": lambda values: values * 1e30,
    "sign_flip": lambda values: -values * 10,
}


async def round_with(
    swarm, tensor_sets, *, faulty=None, cls=None, weights=None, modes=None, fractions=None, **options
):
    """One round of every peer; peer `faulty` runs `cls`."""
    n = len(tensor_sets)
    fractions = fractions or [1] * n
    runners = swarm.runners(tensor_sets, fractions, modes, weights, part_size_bytes=1024, **options)
    if faulty is not None:
        honest = runners[faulty]
        options.pop("group_id", None)
        outputs = options.pop("outputs", None)
        runners[faulty] = cls(
            honest.host,
            honest.group_id,
            tensor_sets[faulty],
            swarm.peer_ids,
            fractions or [1] * n,
            modes,
            honest.weight,
            part_size_bytes=1024,
            outputs=outputs and outputs[faulty],
            **options,
        )
    return await swarm.run(runners)


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float(torch.linalg.vector_norm(x.double() - y.double())) for x, y in zip(a, b))


def partition_of(swarm, fractions):
    """How a round of `swarm` with these fractions cuts the vector into spans and parts."""
    return swarm.runners([tensors(0)] * swarm.n, fractions, part_size_bytes=1024)[0].partition


def part_values(tensor_list, part) -> torch.Tensor:
    return tensor_list[part.tensor_index].view(-1)[part.start : part.stop].double()


@pytest.mark.parametrize("compression", [None, Float16Compression()], ids=["plain", "float16"])
def test_honest_robust_rounds_give_the_plain_mean_and_pass_verification(compression):
    """The tolerance stated in RobustAggregation: honest parts of >= 64 elements come out as the plain
    mean up to float rounding (here 1e-5 of the part's scale; 2**-9 with float16 on the wire),
    smaller parts within the members' spread."""

    async def main():
        async with Swarm(4) as swarm:
            tensor_sets = [tensors(seed) for seed in range(4)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            options = dict(robust=ROBUST, compression=compression or NoCompression())
            fractions = [1, 2, 0, 1]
            reports = await round_with(
                swarm,
                tensor_sets,
                modes=[NODE, NODE, CLIENT, AUX],
                fractions=fractions,
                weights=[1.0, 2.0, 1.0, 0.0],
                **options,
            )
            assert all(report.complete for report in reports), reports
            mean = weighted_mean(originals[:3], [1.0, 1.0, 1.0])  # robust rounds count every member once
            tolerance = 1e-5 if compression is None else 2**-9
            partition = partition_of(swarm, fractions)
            sizes = set()
            for reducer in range(4):
                for part in partition.parts(reducer):
                    sizes.add(part.numel >= 64)
                    exact = part_values(mean, part)
                    spread = max(float((part_values(o, part) - exact).abs().max()) for o in originals[:3])
                    allowed = tolerance * float(exact.abs().max()) if part.numel >= 64 else spread
                    for ts in tensor_sets[:3]:
                        assert float((part_values(ts, part) - exact).abs().max()) <= allowed, part
            assert sizes == {True, False}, "both kinds of parts were checked"
            assert all(torch.equal(t, o) for t, o in zip(tensor_sets[3], originals[3])), "AUX: untouched"

    run(main(), 50)


@pytest.mark.parametrize("attack", ["nan_whole", "nan_few", "inf"])
def test_a_nonfinite_member_is_excluded_by_default_and_the_others_stay_exact(attack):
    async def main():
        async with Swarm(4) as swarm:
            tensor_sets = [tensors(seed) for seed in range(4)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            Attacker.attack = staticmethod(ATTACKS[attack])
            reports = await round_with(swarm, tensor_sets, faulty=3, cls=Attacker)
            attacker = swarm.peer_ids[3]
            for report in reports[:3]:
                assert "NaN or inf" in report.excluded_senders[attacker]
            mean = weighted_mean(originals[:3], [1.0] * 3)
            if attack != "nan_few":  # whole tensors: no part of the attacker's is ever added
                for ts in tensor_sets[:3]:
                    assert distance(ts, mean) <= 1e-4
            for ts in tensor_sets[:3]:
                assert all(torch.isfinite(t).all() for t in ts)

    run(main(), 50)


@pytest.mark.parametrize("attack", ["scaled_1e3", "scaled_1e30", "sign_flip"])
def test_robust_rounds_bound_what_one_member_can_do(attack):
    """CenteredClip: the attacker moves each part by at most its radius over the others' weight; here
    within twice the honest members' spread of their mean, where the plain mean moves by 1e3 to 1e30 x."""

    async def main():
        async with Swarm(4) as swarm:
            tensor_sets = [tensors(seed) for seed in range(4)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            Attacker.attack = staticmethod(ATTACKS[attack])
            reports = await round_with(
                swarm, tensor_sets, faulty=3, cls=Attacker, robust=ROBUST, weights=[1.0, 1.0, 1.0, 1e9]
            )  # robust rounds count everyone once
            assert all(not report.discarded_parts for report in reports[:3]), "honest reducers pass"
            mean = weighted_mean(originals[:3], [1.0] * 3)
            spread = max(distance(ts, mean) for ts in originals[:3])
            for ts in tensor_sets[:3]:
                assert all(torch.isfinite(t).all() for t in ts)
                assert distance(ts, mean) <= 2 * spread

    run(main(), 50)


def test_weights_are_bounded_relative_to_the_group_and_by_the_callers_limits():
    async def main():
        async with Swarm(4) as swarm:
            tensor_sets = [tensors(seed) for seed in range(4)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            await round_with(swarm, tensor_sets, weights=[1.0, 1.0, 1.0, 1e9])
            bounded = weighted_mean(originals, [1.0, 1.0, 1.0, 8.0])  # 8 x the lower median weight
            assert distance(tensor_sets[0], bounded) <= 1e-4
            tensor_sets = [[t.clone() for t in ts] for ts in originals]
            limits = {swarm.peer_ids[3]: 2.0}
            await round_with(
                swarm,
                tensor_sets,
                weights=[1.0, 1.0, 1.0, 1e9],
                weight_limits=limits,
                max_weight_ratio=4.0,
                group_id=b"group-2",
            )
            assert distance(tensor_sets[1], weighted_mean(originals, [1.0, 1.0, 1.0, 2.0])) <= 1e-4

    run(main(), 50)


@pytest.mark.parametrize("compression", [None, Float16Compression()], ids=["plain", "float16"])
def test_a_reducer_that_answers_wrongly_is_caught_and_its_parts_discarded(compression):
    async def main():
        async with Swarm(4) as swarm:
            tensor_sets = [tensors(seed) for seed in range(4)]
            originals = [[t.clone() for t in ts] for ts in tensor_sets]
            options = dict(robust=ROBUST, compression=compression or NoCompression())
            reports = await round_with(swarm, tensor_sets, faulty=1, cls=WrongReducer, **options)
            liar = swarm.peer_ids[1]
            for i, report in enumerate(reports):
                assert list(report.discarded_parts) == [liar], (i, report)
            mean = weighted_mean(originals, [1.0] * 4)
            partition = partition_of(swarm, [1] * 4)
            for i in (0, 2, 3):
                for part in partition.parts(1):  # the liar's span: local values kept
                    assert torch.equal(part_values(tensor_sets[i], part), part_values(originals[i], part))
                for part in partition.parts(2):  # an honest span: averaged
                    exact = part_values(mean, part)
                    if part.numel >= 64:
                        assert float((part_values(tensor_sets[i], part) - exact).abs().max()) <= 2e-3 * float(
                            exact.abs().max()
                        )

    run(main(), 50)


def test_nonfinite_answers_fail_the_span_and_leave_local_values():
    class NaNReducer(AllReduceRunner):
        def reduced(self, part, average):
            return torch.full_like(average, float("nan"))

    async def main():
        async with Swarm(3) as swarm:
            for separate in (False, True):  # results in place, or into outputs
                tensor_sets = [tensors(seed) for seed in range(3)]
                originals = [[t.clone() for t in ts] for ts in tensor_sets]
                outputs = [[torch.zeros_like(t) for t in ts] for ts in tensor_sets] if separate else None
                reports = await round_with(
                    swarm,
                    tensor_sets,
                    faulty=2,
                    cls=NaNReducer,
                    outputs=outputs,
                    group_id=b"nan-%d" % separate,
                )
                for i in (0, 1):
                    (failure,) = reports[i].failed_spans
                    assert failure.reducer == swarm.peer_ids[2] and "NaN or inf" in failure.reason
                    results = outputs[i] if separate else tensor_sets[i]
                    assert all(torch.isfinite(t).all() for t in results)
                    for part in partition_of(swarm, [1] * 3).parts(2):  # the span it answered: local values
                        assert torch.equal(part_values(results, part), part_values(originals[i], part))

    asyncio.run(asyncio.wait_for(main(), 50))
