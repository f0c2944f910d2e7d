"""The adversarial client (sim/adversary.py): production core_sm refuses it without harm to the
honest tenants; the trust-all profile (no ownership checks) is caught as F22."""
from __future__ import annotations

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
