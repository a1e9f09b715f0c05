"""`benchmarks.units.plans`: which GPUs the pd unit and the encoder unit get on a machine of N GPUs (issue 31's
split, measured by `benchmarks.gpu units`), and the settings that make each unit what it is."""

from __future__ import annotations

from pathlib import Path

from benchmarks import gpu
from benchmarks.units import ENDPOINT, UnitsPlan, plans


def test_one_gpu_or_none_puts_both_units_on_it() -> None:
    assert plans(0) == plans(1) == [UnitsPlan((0,), (0,))]


def test_the_pd_unit_keeps_gpu_0_and_the_encoders_take_one_more_gpu_per_plan_up_to_three() -> None:
    assert plans(2) == [UnitsPlan((0,), (1,))]
    assert plans(4) == [UnitsPlan((0,), (1,)), UnitsPlan((0,), (1, 2)), UnitsPlan((0,), (1, 2, 3))]
    assert plans(8) == plans(4)
    assert plans(8, most_encoders=7)[-1] == UnitsPlan((0,), tuple(range(1, 8)))


def test_each_unit_sees_its_own_gpus_and_is_named_by_its_encoders() -> None:
    plan = UnitsPlan((0,), (1, 2))
    assert (plan.visible_devices("pd"), plan.visible_devices("encoder")) == ("0", "1,2")
    assert plan.prefix == "units-2enc-"
    for role in ("pd", "encoder"):
        assert plan.settings(role) == [
            ("server", "role", role),
            ("encoder", "count", 2),
            ("endpoints", "encoder", ENDPOINT),
        ]
    assert ENDPOINT.replace("{gpu}", "1") == "tcp://127.0.0.1:7101"


def test_the_driver_takes_the_units_part_and_writes_each_units_settings(tmp_path: Path) -> None:
    args = gpu.parse_args(["units", "--result-dir", str(tmp_path), "--set", "encoder.quantization=fp8"])
    run = gpu.Run(tmp_path, tmp_path, args)
    run.raw.mkdir()
    path = gpu.stack_config(run, UnitsPlan((0,), (1,)).settings("encoder"), file_name="enc.toml")
    text = path.read_text()
    assert (
        'role = "encoder"' in text and 'quantization = "fp8"' in text and 'encoder = "tcp://127.0.0.1:710{gpu}"' in text
    )
