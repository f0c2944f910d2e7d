"""The adversarial client (sim/adversary.py): production core_sm refuses it without harm to the
honest tenants; the trust-all profile (no ownership checks) is caught as F22."""
from __future__ import annotations

from typing import Any

from mpcache.sim.adversary import ADVERSARY, ATTACKS, TENANT_HARMED
from mpcache.sim.profiles import PROFILES
from mpcache.sim.runner import run_scenario, run_seed
from mpcache.sim.scenario import draw_scenario

# Seeds whose world runs the adversary (drawn in ~40% of seeds).
ADVERSARY_SEEDS = [s for s in range(120) if draw_scenario(s).config.adversary][:30]


def test_adversary_is_drawn_in_some_seeds() -> None:
    assert 20 <= len([s for s in range(100) if draw_scenario(s).config.adversary]) <= 60


def test_default_refuses_the_adversary_without_harm() -> None:
    refused: dict[str, int] = {}
    sent = 0
    for seed in ADVERSARY_SEEDS:
        result, world = run_scenario(draw_scenario(seed), "default")
        assert result.ok, f"seed {seed}: {result.violation.reason()[:400] if result.violation else ''}"
        assert world.adversary is not None
        sent += world.adversary.stats["adversary_sent"]
        for name, n in world.adversary.stats.items():
            if name.startswith("refused "):
                refused[name] = refused.get(name, 0) + n
    # Not vacuous: it sent a lot, and the ownership and bound checks answered it.
    assert sent > 20 * len(ADVERSARY_SEEDS)
    assert refused.get("refused forbidden", 0) > 50, refused
    assert refused.get("refused validation", 0) > 10, refused
    assert refused.get("refused unknown_transfer", 0) > 0, refused


def test_trust_all_is_caught_as_tenant_harmed() -> None:
    assert PROFILES["trust-all"].failure == TENANT_HARMED
    caught = []
    for seed in range(200):
        r = run_seed(seed, "trust-all")
        if r.violation is not None:
            assert r.violation.code == TENANT_HARMED, f"seed {seed}: {r.violation.reason()[:300]}"
            caught.append(seed)
            if len(caught) == 3:
                break
    assert len(caught) == 3, caught
    # The same worlds pass on production core_sm.
    assert all(run_seed(seed).ok for seed in caught)


def test_adversary_replays_and_is_traced() -> None:
    seed = ADVERSARY_SEEDS[0]
    result = run_seed(seed, keep_lines=True)
    kinds = {line.split("adversary ", 1)[1] for line in result.lines if f" {ADVERSARY} " in line and "adversary " in line}
    assert kinds <= set(ATTACKS) and len(kinds) >= 5, kinds
    assert run_seed(seed).trace_hash == result.trace_hash


def test_an_instance_reaped_from_its_owner_is_not_the_adversarys(monkeypatch: Any) -> None:
    """Hostile finding 4: after a reap, another peer registered the victim's id and locked the
    victim out. The adversary races the owner's registering again; taking the id is F22."""
    import attrs

    from mpcache.core_sm.server_instances import InstanceMachine
    from mpcache.sim.profiles import PROFILES
    from mpcache.sim.scenario import FaultSpec, server_name, worker_name

    ttl = PROFILES["default"].instance_ttl
    assert ttl is not None
    base = draw_scenario(3)
    # the worker is cut off after its first heartbeat, for 2 TTLs: reaped while the adversary runs
    cut = FaultSpec(1.5, "partition", (worker_name(0, 0), server_name(0), False, 2 * ttl))
    heal = 2 * ttl + 3.0
    scenario = attrs.evolve(base, config=attrs.evolve(base.config, safety_duration=heal, adversary=True), faults=(cut,))
    result, world = run_scenario(scenario, "default")
    assert result.ok, result.violation.reason()[:400] if result.violation else ""
    assert world.adversary is not None and world.adversary.reaped  # it saw the reap and raced
    assert world.stats["instances_reaped"] >= 1
    # a server that frees a reaped id for anyone: the adversary takes it
    monkeypatch.setattr(InstanceMachine, "_reserved_for_another", lambda self, iid, peer, now: False)
    bad, _ = run_scenario(scenario, "default")
    assert bad.violation is not None and bad.violation.code == TENANT_HARMED, bad.violation
    assert "reaped from its owner" in bad.violation.reason()
