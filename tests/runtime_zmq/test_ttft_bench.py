"""``mpcache-bench ttft``'s model arithmetic and options (no vLLM: the bench itself is a command)."""
from __future__ import annotations

import argparse

import pytest

from mpcache.bench import bench_ttft


def test_kv_bytes_and_flop_per_token_by_hand() -> None:
    tiny = bench_ttft.MODELS["tiny"]
    # 4 layers x K and V x 4 KV heads x 64 x float32
    assert bench_ttft.kv_bytes_per_token(tiny) == 2 * 4 * 4 * 64 * 4 == 8192
    # per layer: q and o 768^2 each, k and v 768 x 256 each, the gated MLP 3 x 768 x 2048; 2 FLOP a weight
    assert bench_ttft.prefill_flop_per_token(tiny) == 4 * 2 * (2 * 768**2 + 2 * 768 * 256 + 3 * 768 * 2048)
    # causal attention adds QK and AV over (tokens + 1) / 2 keys on average: 4 x hidden FLOP a key
    assert bench_ttft.prefill_flop_per_token(tiny, 4095) - bench_ttft.prefill_flop_per_token(tiny) == 4 * 4 * 768 * 2048


def test_gqa_model_spends_flop_per_kv_byte_like_llama3_8b_and_tiny_does_not() -> None:
    def ratio(dims: dict[str, int], dtype_bytes: int = 4) -> float:
        return bench_ttft.prefill_flop_per_token(dims) / bench_ttft.kv_bytes_per_token(dims, dtype_bytes)

    llama = ratio(bench_ttft.LLAMA3_8B, 2)
    assert 100e3 < llama < 110e3
    assert 0.9 * llama < ratio(bench_ttft.MODELS["gqa"]) < 1.2 * llama
    assert ratio(bench_ttft.MODELS["tiny"]) < llama / 10
    for dims in bench_ttft.MODELS.values():
        assert dims["hidden"] % dims["heads"] == 0 and dims["heads"] % dims["kv_heads"] == 0
        assert dims["hidden"] // dims["heads"] >= 32  # the smallest head vLLM's CPU attention takes


def _parser_actions() -> list[argparse.Action]:
    captured: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def grab(self: argparse.ArgumentParser, *a: object, **k: object) -> argparse.Namespace:
        captured.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = grab  # type: ignore[assignment, method-assign]
    try:
        with pytest.raises(SystemExit):
            bench_ttft.main([])
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    return captured[0]._actions


def test_every_public_option_is_documented() -> None:
    public = [a for a in _parser_actions() if a.help is not argparse.SUPPRESS and a.option_strings != ["-h", "--help"]]
    assert {"--model", "--tokens", "--samples", "--vllm-venv", "--model-dir", "--connector-config", "--keep"} <= {
        s for a in public for s in a.option_strings}
    for action in public:
        assert action.help, f"{action.option_strings} has no help text"


def test_unknown_model_is_refused_with_the_choices(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    venv = __import__("pathlib").Path(str(tmp_path))
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("")
    assert bench_ttft.main(["--vllm-venv", str(venv), "--model", "tiny,llama70b"]) == 2
    err = capsys.readouterr().err
    assert "llama70b" in err and "tiny" in err and "gqa" in err


def test_two_models_print_one_summary_row_each_against_their_own_recompute(
        tmp_path: object, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    venv = __import__("pathlib").Path(str(tmp_path))
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("")
    ran: list[str] = []

    def fake_run(args: argparse.Namespace, name: str, vpy: str) -> dict[str, object]:
        ran.append(name)
        rec, hit = (2.0, 0.04) if name == "tiny" else (8.0, 0.04)
        return {"model": name, "flop_per_kv_byte": 6144.75 if name == "tiny" else 115208.0, "recompute_s": rec,
                "l1_hit_s": hit, "l1x": rec / hit, "disk_hit_s": 0.08, "diskx": rec / 0.08, "first_pass_cost": 0.01,
                "load": (1.0, 1.0, 1.0)}

    monkeypatch.setattr(bench_ttft, "_run_model", fake_run)
    assert bench_ttft.main(["--vllm-venv", str(venv), "--model", "tiny,gqa"]) == 0
    assert ran == ["tiny", "gqa"]
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| tiny", "| gqa"))]
    assert rows == ["| tiny | 6.1k | 1.00 | 2.000 | 0.040 | 50.0x | 0.080 | 25.0x | +1.0% |",
                    "| gqa | 115.2k | 1.00 | 8.000 | 0.040 | 200.0x | 0.080 | 100.0x | +1.0% |"]
