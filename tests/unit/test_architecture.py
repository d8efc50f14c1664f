"""The package's shape (DESIGN.md §2, docs/architecture.md): layers import downward only, no
import circles, files and functions of a readable size (read from the source by
tests/architecture.py)."""

from architecture import circles, layer, load, upward

# Argparse tables are long by nature: one add_argument per flag.
TABLES = {"thunderpool.cli.build_parser"}
# Over the limits today, each named so that none is added; the list may only shrink.
LARGE_FILES: set[str] = set()
LONG_FUNCTIONS: set[str] = set()


def test_no_import_circles():
    assert circles(load()) == []


def test_every_import_runs_down_the_layers():
    modules = load()
    for name in modules:
        layer(name)  # every module sits in a layer (KeyError names one that does not)
    assert upward(modules) == []


def test_no_file_over_400_lines():
    over = {m.name for m in load().values() if m.lines > 400}
    assert over <= LARGE_FILES, f"files over 400 lines: {sorted(over - LARGE_FILES)}"
    assert LARGE_FILES <= over, f"now small enough, drop from LARGE_FILES: {LARGE_FILES - over}"


def test_no_function_over_80_lines():
    long = {f"{m.name}.{f}" for m in load().values() for f, n in m.functions if n > 80} - TABLES
    assert long <= LONG_FUNCTIONS, f"functions over 80 lines: {sorted(long - LONG_FUNCTIONS)}"
    assert LONG_FUNCTIONS <= long, f"now short enough: {LONG_FUNCTIONS - long}"


def test_the_graph_reader_sees_circles_and_upward_imports(tmp_path, monkeypatch):
    """The rules can fail: a planted circle and an upward import are found."""
    import architecture

    pkg = tmp_path / "thunderpool"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from thunderpool.engine import b\n")
    (pkg / "engine" / "b.py").write_text("import thunderpool.engine.a\nimport thunderpool.cli\n")
    (pkg / "cli.py").write_text("")
    monkeypatch.setattr(architecture, "ROOT", tmp_path)
    modules = architecture.load()
    assert circles(modules) == [["thunderpool.engine.a", "thunderpool.engine.b"]]
    assert upward(modules) == [("thunderpool.engine.b", "thunderpool.cli")]
