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


def test_a_failed_disk_write_is_said_and_kept_and_the_kernel_still_served(tmp_path, monkeypatch):
    """The disk level is an optimisation: a write that fails (here the export itself, as a full
    disk would) leaves the compiled kernel in use, but is announced and kept for
    ``graphc compile`` to name."""

    class Compiled:
        def export_to_c(self, folder, name, function_prefix):
            raise OSError(28, "No space left on device")

    monkeypatch.setenv("GRAPHC_KERNEL_CACHE", "1")
    kernel = Compiled()
    cache = CompileCache("toy", lambda *key: kernel, "source text", cache_dir=tmp_path)
    heard = []
    with reporting_compiles(heard.append):
        assert cache.get((8,)) is kernel
        assert cache.get((8,)) is kernel                  # from memory, not compiled again
    assert cache.stats["compiles"] == 1 and cache.stats["disk_errors"] == 1
    assert cache.last_disk_error == f"{cache.path((8,))}: OSError: [Errno 28] No space left on device"
    assert [h for h in heard if "could not write" in h] == [
        f"could not write to the kernel cache: {cache.last_disk_error} (the next process that needs "
        "this kernel compiles it again)"]
    assert list(tmp_path.iterdir()) == []                 # the staging folder went with it
