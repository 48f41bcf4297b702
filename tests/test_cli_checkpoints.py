"""scripts/quantize.py and convert_hf_checkpoint.py on bad output directories and group sizes: a one-line
`error:` naming the value, and the user's files never lost; a checkpoint replaced only once the new one is whole."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT, one_line_error

sys.path.insert(0, str(ROOT / "scripts"))
import convert_hf_checkpoint  # noqa: E402
import quantize  # noqa: E402


def user_files(directory):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "thesis.tex").write_text("years of work")
    (directory / "notes").mkdir()
    (directory / "notes" / "a.txt").write_text("more")
    return snapshot(directory)


def snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() if p.is_file() else None for p in directory.rglob("*")}


def test_quantize_refuses_an_out_dir_holding_other_files(tiny_ckpt, tmp_path, capsys):
    before = user_files(tmp_path / "mine")
    with pytest.raises(SystemExit) as exit_info:
        quantize.main(["--checkpoint_path", str(tiny_ckpt), "--mode", "int8", "--out_dir", str(tmp_path / "mine")])
    err = one_line_error(capsys, exit_info)
    assert str(tmp_path / "mine") in err and "not a kvlab checkpoint" in err
    assert snapshot(tmp_path / "mine") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "tiny"]  # no temporary directory left


def test_convert_refuses_an_out_dir_holding_other_files(tmp_path, capsys):
    before = user_files(tmp_path / "mine")
    (tmp_path / "hf").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        convert_hf_checkpoint.main(["--hf_dir", str(tmp_path / "hf"), "--out_dir", str(tmp_path / "mine")])
    assert "not a kvlab checkpoint" in one_line_error(capsys, exit_info)
    assert snapshot(tmp_path / "mine") == before


def test_the_source_checkpoint_is_never_the_destination(tiny_ckpt, capsys):
    before = snapshot(tiny_ckpt)
    with pytest.raises(SystemExit) as exit_info:
        quantize.main(
            ["--checkpoint_path", str(tiny_ckpt), "--mode", "int8", "--out_dir", str(tiny_ckpt / ".." / tiny_ckpt.name)]
        )
    assert "is the source checkpoint" in one_line_error(capsys, exit_info)
    assert snapshot(tiny_ckpt) == before and "quantization" not in json.loads((tiny_ckpt / "config.json").read_text())


def test_an_existing_checkpoint_is_replaced_only_once_the_new_one_is_complete(tiny_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "q"
    quantize.main(["--checkpoint_path", str(tiny_ckpt), "--mode", "int8", "--out_dir", str(out)])
    before = snapshot(out)

    def interrupted_write(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvlab.checkpoint.save_file", interrupted_write)
    with pytest.raises(SystemExit):
        quantize.main(["--checkpoint_path", str(tiny_ckpt), "--mode", "int4", "--out_dir", str(out)])
    assert snapshot(out) == before  # the interrupted write left the old checkpoint whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "tiny"]
    monkeypatch.undo()
    quantize.main(["--checkpoint_path", str(tiny_ckpt), "--mode", "int4", "--out_dir", str(out)])
    assert json.loads((out / "config.json").read_text())["quantization"] == {"mode": "int4", "groupsize": 32}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "tiny"]


@pytest.mark.parametrize("groupsize", ["0", "-32", "48"])
def test_quantize_refuses_a_bad_group_size(groupsize, tiny_ckpt, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        quantize.main(
            [
                "--checkpoint_path",
                str(tiny_ckpt),
                "--mode",
                "int4",
                "--groupsize",
                groupsize,
                "--out_dir",
                str(tmp_path / "q"),
            ]
        )
    assert f"got {groupsize}" in one_line_error(capsys, exit_info) and not (tmp_path / "q").exists()
