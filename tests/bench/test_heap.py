"""bench/heap.py: the in-process host-memory probe on the CPU tiny engine."""

import json
import tracemalloc

from doublesparse.bench import heap


def test_heap_probe_reports_growth_per_request(tmp_path):
    out = tmp_path / "heap.json"
    rc = heap.main(["--engine-factory", "doublesparse.server.fake_engine:tiny_engine",
                    "--engine-kwargs", '{"max_position_embeddings": 512}', "--rounds", "2", "--requests", "6",
                    "--prompt-len", "40", "--shared-prefix", "16", "--max-tokens", "6", "--tracemalloc",
                    "--result-json", str(out)])
    assert rc == 0
    # the run stops the tracing it started: a test worker that traced every later allocation ran
    # pure-Python code (transformers' GGUF name maps) many times slower
    assert not tracemalloc.is_tracing()
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["requests"] == 18 and s["rounds"] == 2
    for key in ("heap_in_use_bytes_per_request", "rss_bytes_per_request", "traced_bytes_per_request"):
        assert isinstance(s[key], float)
    assert isinstance(s["containers_grown"], dict) and isinstance(s["traced_growth_top"], list)
    rounds = doc["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    # every request ended (aborted ones too): the engine holds none of them afterwards
    assert all(r["containers"].get("engine._reqs", 0) == 0 for r in rounds)
    # aborted requests (every 4th) stopped early, so fewer tokens than 6 x 6
    assert all(0 < r["tokens"] < 36 for r in rounds)


def test_container_sizes_walks_package_objects():
    class Part:
        __module__ = "doublesparse.fake"

        def __init__(self):
            self.items = [1, 2]

    class Root:
        def __init__(self):
            self.a = {"x": 1}
            self.part = Part()
    Part.__module__ = "doublesparse.fake"
    sizes = heap.container_sizes(Root())
    assert sizes == {"engine.a": 1, "engine.part.items": 2}
