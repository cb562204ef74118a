"""tests/run_env.py: TorchDynamo is turned off only for runs whose arguments leave [compile] enable off."""

from run_env import compiles, run_env


def test_compile_flag_read_as_the_recipe_reads_it():
    assert not compiles(["--training.steps", "5"])
    assert compiles(["--compile.enable", "true"]) and compiles(["--compile.enable"])  # a bare flag is on
    assert compiles(["--compile.enable", "--compile.backend", "aot_eager"])
    assert not compiles(["--compile.enable", "false"]) and not compiles(["--compile.enable=False"])
    assert compiles(["--compile.enable", "false", "--compile.enable", "true"])  # the last mention wins
    assert not compiles(["--compile.enable", "true", "--compile.enable=false"])


def test_dynamo_is_off_only_where_nothing_compiles():
    assert run_env(["--training.steps", "5"], OMP_NUM_THREADS="1")["TORCHDYNAMO_DISABLE"] == "1"
    env = run_env(["--compile.enable", "true"], OMP_NUM_THREADS="1")
    assert env.get("TORCHDYNAMO_DISABLE") != "1" and env["OMP_NUM_THREADS"] == "1"
