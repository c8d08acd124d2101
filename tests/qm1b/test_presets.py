"""Presets: a dataset's level of theory by name, an ordinary value that any single option overrides,
recorded with the settings it resolved to."""

from __future__ import annotations

import dataclasses

import pytest

from pyscf_ipu.config import RKSConfig
from qm1b.cli import _run_settings, main, parse_arguments
from qm1b.presets import PRESETS
from qm1b.store import open_dataset


def settings_of(argv: list[str]) -> tuple:
    return _run_settings(parse_arguments(["generate", *argv]))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_sets_its_level_and_any_option_beside_it_wins(name):
    preset = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(RKSConfig)}
    assert set(preset.settings) <= fields and {"xc", "basis", "grid_level", "dispersion"} <= set(preset.settings)
    resolved = RKSConfig(**preset.settings)  # its dispersion, auto, resolved to the functional's own
    gen, dft = settings_of(["--preset", name])
    assert gen.preset == name and all(getattr(dft, k) == getattr(resolved, k) for k in preset.settings)
    other = "none" if resolved.dispersion != "none" else "d3bj"
    gen, dft = settings_of(["--grid-level", "1", "--preset", name, "--dispersion", other])  # either side of it
    assert (dft.grid_level, dft.dispersion) == (1, other) and dft.grid_level != resolved.grid_level
    assert all(getattr(dft, k) == v for k, v in preset.settings.items() if k not in ("grid_level", "dispersion"))


def test_the_presets_name_the_datasets_levels():
    """The levels the datasets' papers state (the README lists each with its source)."""
    level = {name: (p.settings["xc"], p.settings["basis"]) for name, p in PRESETS.items()}
    assert level == {"qm1b": ("b3lyp5", "sto-3g"), "qm9": ("b3lyp", "6-31g(2df,p)"), "ani1x": ("wb97x", "6-31g*"),
                     "nabladft": ("wb97x-d", "def2-svp")}  # fmt: skip
    assert PRESETS["qm1b"].settings["grid_level"] == 0 and PRESETS["qm1b"].settings["precision"] == "float32"
    dispersions = {name: RKSConfig(**p.settings).dispersion for name, p in PRESETS.items()}
    assert dispersions == {"qm1b": "none", "qm9": "none", "ani1x": "none", "nabladft": "chg"}


def test_a_functional_beside_a_preset_brings_its_own_dispersion():
    assert settings_of(["--preset", "ani1x", "--xc", "wb97x-d"])[1].dispersion == "chg"
    assert settings_of(["--preset", "nabladft", "--xc", "wb97x"])[1].dispersion == "none"


def test_without_a_preset_the_generators_defaults_stand():
    gen, dft = settings_of([])
    assert gen.preset is None and (dft.xc, dft.basis, dft.grid_level) == ("b3lyp5", "sto-3g", 0)


def test_an_unknown_preset_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's own usage error
        main(["generate", "--preset", "spice", "--out", "never"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice: 'spice'" in err[0] and "ani1x" in err[0]


def test_the_dataset_records_the_preset(tmp_path):
    xyz = tmp_path / "water.xyz"
    xyz.write_text("3\nwater\nO 0 0 0.1173\nH 0 0.7572 -0.4692\nH 0 -0.7572 -0.4692\n")
    out = tmp_path / "out"
    assert main(["generate", "--preset", "qm1b", "--geometries", str(xyz), "--out", str(out), "--no-progress"]) == 0
    settings = open_dataset(out).attrs["settings"]
    assert settings["preset"] == "qm1b" and (settings["xc"], settings["basis"]) == ("b3lyp5", "sto-3g")
    # resumed without it, the settings differ: refused, one line
    assert main(["generate", "--geometries", str(xyz), "--out", str(out), "--resume", "--no-progress"]) == 2
