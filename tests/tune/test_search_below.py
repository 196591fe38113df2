"""The search's early stop (:class:`ivq_debug.tune.search.Below`) through the interface a trial calls
(:class:`ivq_debug.tune.verify.Stop`): told the running trial's model bytes and HTP cycles by
:meth:`~ivq_debug.tune.verify.Stop.observe`, it weighs a rival by them; a plain function of the worst SQNRs is a stop
that ignores them. The SQNRs are PP-OCRv4's baseline and a16w16 on CPU-QDQ (2.73 and 20.40 dB, docs/tune.md), the
sizes and cycles round figures; the search run end to end with and without the stop, on real trials:
``tests/tune/test_search_stop.py`` (slow); a real trial telling its stop the cost: ``tests/tune/test_reference.py``."""

from __future__ import annotations

from ivq_debug.tune.search import Below
from ivq_debug.tune.verify import Stop, as_stop


def test_below_stops_a_lever_a_cheaper_rival_beats_once_told_its_cost() -> None:
    rival = (20.40, 1_000_000, None)  # eligible, measured in full: 20.40 dB at 1.0 MB, no HTP profile
    stop = Below(("y",), base=2.73, floor=5.0, rivals=(rival,))
    assert isinstance(stop, Stop) and as_stop(stop) is stop
    assert not stop({"y": 4.0})  # below the floor, but no cost told yet: no rival is known to cost less
    stop.observe(model_bytes=1_200_000)  # the lever quantized: 1.2 MB
    assert stop({"y": 4.0}) and not stop({"y": 5.0}) and not stop({})  # at the floor it may still be chosen
    stop.observe(cycles=3.5e6)  # its first sample's cycles: the rival has none, so the bytes decide
    assert stop.model_bytes == 1_200_000 and stop({"y": 4.0})
    assert stop({"y": 2.0})  # below the baseline: refused whatever it costs
    # a rival with cycles is weighed by them when the lever has them too: 3.0e6 <= 3.5e6 although 1.5 MB > 1.2 MB
    heavy = Below(("y",), base=2.73, floor=5.0, rivals=((20.40, 1_500_000, 3.0e6),))
    heavy.observe(model_bytes=1_200_000, cycles=3.5e6)
    assert heavy({"y": 4.0})
    heavy.observe(cycles=2.5e6)  # a faster lever: the rival costs more cycles, nothing stops it
    assert not heavy({"y": 4.0}) and heavy.model_bytes == 1_200_000


def test_a_plain_function_is_a_stop_that_ignores_the_cost() -> None:
    seen: list[dict[str, float]] = []
    stop = as_stop(lambda worst: seen.append(dict(worst)) or worst["y"] < 3.0)
    assert isinstance(stop, Stop) and as_stop(None) is None
    assert stop.observe(model_bytes=1_200_000, cycles=3.5e6) is None and seen == []
    assert stop({"y": 2.0}) and not stop({"y": 4.0}) and seen == [{"y": 2.0}, {"y": 4.0}]
