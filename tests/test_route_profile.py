"""loadtest/route_profile.py: the route script's sections timed by Redis's own clock."""

from __future__ import annotations

import asyncio

from router.redis_keys import Scripts, load_lua


def test_the_probed_script_times_every_section_and_leaves_the_real_one_registered():
    from loadtest.route_profile import SECTIONS, probe_sections_of, profile

    src = probe_sections_of(load_lua("route"), "k")
    assert src.count("redis.call('TIME')") == len(SECTIONS)
    before = Scripts._sources.get("route")
    got = asyncio.run(profile("redis://127.0.0.1:6379/0", n=4, blocks=8, iters=80))
    assert set(got) == {"start->walked", "walked->load_read", "load_read->chosen",
                        "chosen->reserved", "reserved->end", "total"}
    assert got["total"] > 0 and all(v >= 0 for v in got.values())
    assert got["total"] >= got["reserved->end"]  # the predicted entries' write is in it
    assert Scripts._sources.get("route") == before  # the probed source is not left behind
