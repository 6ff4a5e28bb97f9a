"""Whether the C++ CPU kernel builds here (tests/test_native.py, tests/test_caches_and_calls.py)."""


def native_builds() -> bool:
    """Whether the C++ CPU kernel builds and loads here (auto takes it then; else the tiled kernel, with a warning)."""
    from longreach.attention import native

    try:
        native.extension()
    except native.BuildError:
        return False
    return True
