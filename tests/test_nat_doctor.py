"""`plexus doctor` against a public peer on 127.0.0.1 (a plain DHT: it serves AutoNAT and relays by
default), and against nobody."""

import pytest

from plexus.cli import doctor
from plexus.cli.main import main
from plexus.dht.dht import DHT


@pytest.mark.timeout(60)
def test_doctor_reports_a_healthy_local_setup(capsys):
    public = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        peer = str(public.get_visible_maddrs()[0])
        report = doctor.diagnose(peer, ["/ip4/127.0.0.1/tcp/0"], relays=[peer], timeout=10)
        assert report["problems"] == [], report
        assert report["nat"].startswith("none"), report
        assert report["reachability"] == "public", report
        assert abs(report["clock_skew"]) < 1.0, report
        assert report["relays"][0]["relay"] == peer and "error" not in report["relays"][0], report
        assert report["circuit_addrs"] and "/p2p-circuit/p2p/" in report["circuit_addrs"][0], report
        # The command line prints the same report.
        assert (
            main(["doctor", "--peer", peer, "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--timeout", "10"]) == 0
        )
        out = capsys.readouterr().out
        assert "reachability: public" in out and "No problems found." in out, out
    finally:
        public.shutdown()


@pytest.mark.timeout(30)
def test_doctor_says_what_to_change_when_the_peer_is_unreachable(capsys):
    report = doctor.diagnose(
        "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo",
        ["/ip4/127.0.0.1/tcp/0"],
        timeout=3,
    )
    assert report["problems"] and "could not connect" in report["problems"][0], report
    assert "port is open" in report["advice"][0]
    assert "What to change" in doctor.format_report(report)
