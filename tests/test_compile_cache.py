"""The kernel compile cache's bookkeeping that needs no compiler: who hears about compiles."""

from graphc.kernels.compile_cache import CompileCache, reporting_compiles


def test_compiles_are_announced_and_cache_hits_are_not(monkeypatch):
    monkeypatch.setenv("GRAPHC_KERNEL_CACHE", "0")        # in-process level only
    built = []
    cache = CompileCache("toy", lambda *key: built.append(key) or ("kernel", key), "source text")
    heard = []
    with reporting_compiles(heard.append):
        assert cache.get((8, 1024)) == ("kernel", (8, 1024))
        cache.get((8, 1024))                              # in memory: nothing to say
    cache.get((16, 1024))                                 # nobody listening
    assert built == [(8, 1024), (16, 1024)]
    assert heard[0] == "compiling toy (8, 1024)"
    assert heard[1].startswith("compiled toy in ") and heard[1].endswith(" s")
    assert len(heard) == 2
