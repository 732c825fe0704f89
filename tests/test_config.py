"""EngineConfig / SamplingConfig and config files: bad values are one clear ConfigError, never a TypeError further on
or a silently wrong run."""

import pytest

from specpilot.config import EngineConfig, SamplingConfig, load_config_file
from specpilot.errors import ConfigError


@pytest.mark.parametrize("field, value, message", [
    ("num_draft_tokens", "8", "num_draft_tokens must be a whole number, got '8'"),
    ("max_new_tokens", 4.0, "max_new_tokens must be a whole number, got 4.0"),
    ("num_draft_tokens", True, "num_draft_tokens must be a whole number, got True"),
    ("pdl", 1, "pdl must be true or false, got 1"),
    ("compile", "false", "compile must be true or false, got 'false'"),
    ("drafter_kind", 3, "drafter_kind must be one of"),  # a field's own check speaks first
    ("l2_prefetch", "0.5", "l2_prefetch is a fraction"),
    ("stop_strings", ("a", 3), "stop_strings must be a list of strings"),
    ("sampling", {"temperature": 1.0}, "sampling must be a mapping of"),
])
def test_engine_config_rejects_a_value_of_the_wrong_type(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**{field: value})


def test_the_type_check_names_a_value_the_field_checks_would_trip_over():
    """`"x" <= 0` raises a TypeError inside the value checks: the type's message is what the user sees."""
    with pytest.raises(ConfigError, match="temperature must be a number, got 'hot'"):
        SamplingConfig(temperature="hot")


def test_engine_config_takes_an_int_where_a_number_is_asked():
    assert EngineConfig(l2_prefetch=0).l2_prefetch == 0
    assert SamplingConfig(temperature=1, top_p=1).temperature == 1


def test_sampling_config_checks_types_too():
    with pytest.raises(ConfigError, match="top_k must be a whole number"):
        SamplingConfig(top_k=2.5)


def test_from_dict_sampling_and_stop_strings():
    cfg = EngineConfig.from_dict({"sampling": {"temperature": 0.7, "top_k": 5}, "stop_strings": "END"})
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.top_k == 5
    assert cfg.stop_strings == ("END",)  # one stop string, not three characters
    assert EngineConfig.from_dict({"stop_strings": ["a", "b"]}).stop_strings == ("a", "b")
    with pytest.raises(ConfigError, match=r"unknown sampling fields: \['temp'\]"):
        EngineConfig.from_dict({"sampling": {"temp": 1.0}})
    with pytest.raises(ConfigError, match=r"unknown config fields: \['foo'\]"):
        EngineConfig.from_dict({"foo": 1})


@pytest.mark.parametrize("text, message", [
    ("a: [\n", "is not valid YAML/JSON: .*line 2"),
    ("- 1\n- 2\n", "must hold a mapping of field: value, got a list"),
    ("just words\n", "must hold a mapping of field: value, got a str"),
])
def test_load_config_file_rejects_what_is_not_a_mapping(tmp_path, text, message):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config_file(f)


def test_load_config_file_reads_yaml_json_and_empty(tmp_path):
    (tmp_path / "a.yaml").write_text("num_draft_tokens: 8\npdl: false\n")
    (tmp_path / "b.json").write_text('{"num_draft_tokens": 4}')
    (tmp_path / "c.yaml").write_text("")
    assert load_config_file(tmp_path / "a.yaml") == {"num_draft_tokens": 8, "pdl": False}
    assert load_config_file(tmp_path / "b.json") == {"num_draft_tokens": 4}
    assert load_config_file(tmp_path / "c.yaml") == {}
    with pytest.raises(ConfigError, match="cannot read deployment file"):
        load_config_file(tmp_path / "missing.yaml", "deployment file")


@pytest.mark.parametrize("command", [["bench"], ["generate", "--prompt", "hi"], ["optimize"]])
@pytest.mark.parametrize("text, message", [
    ("a: [\n", "is not valid YAML/JSON"),
    ("- 1\n", "must hold a mapping"),
    ("num_draft_tokens: x\n", "num_draft_tokens must be a whole number, got 'x'"),
])
def test_commands_reject_a_bad_config_file_in_one_line(tmp_path, monkeypatch, capsys, command, text, message):
    """No traceback, exit 2, and no model loaded first."""
    import specpilot.engine
    from specpilot.cli import main

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the config file was checked")

    monkeypatch.setattr(specpilot.engine, "load_target", no_load)
    f = tmp_path / "c.yaml"
    f.write_text(text)
    assert main([*command, "--config", str(f)]) == 2
    assert message in capsys.readouterr().err
