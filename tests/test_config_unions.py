"""The `[model]` and `[outer]` sections as discriminated unions (issue 36, item 3): a field
of the other model family, or a setting of another exchange rule, is an unknown key of the
form given, refused on one line that names it; and what every job records (its dump, the
bytes its config CID hashes: trainer/config_dump.py) is what it was before the unions,
pinned by CID for each example job and for a job using each newer setting."""

from __future__ import annotations

import copy
from pathlib import Path

import dag_cbor
import pytest
from pydantic import ValidationError

from lineage.store.cid import DAG_CBOR, cid_for
from lineage.store.runconfig import UNRECORDED, RunConfig
from trainer.config import (
    EagerOuter,
    GptConfig,
    JobConfig,
    LlamaConfig,
    ModelConfig,
    OuterConfig,
    PartialOuter,
    RestartOuter,
    SyncOuter,
    load_job,
    one_line,
)
from trainer.errors import ConfigError
from workers.run.jobfile import load_job_file

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "t", "outer": {"steps": 2, "inner_steps": 8}}


def job_dict(**sections: dict) -> dict:
    data = copy.deepcopy(BASE)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def refusal(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_job(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def recorded_cid(job: JobConfig) -> str:
    """The CID of the job's recorded dump, as the config block holds it (less its code hash
    and data record, which change with any edit to trainer/ and with the corpus)."""
    return str(cid_for(dag_cbor.encode(job.model_dump(mode="json", exclude=set(UNRECORDED))), DAG_CBOR))


# --- the recorded dump: pinned from the code before the unions ---------------------------

#: Computed on main at 034ef66 (before the unions), by the same dump and encoding.
PINNED = {
    "examples/bpe.toml": "bafyreihbhh6bxlhr56tl5zwbw2qgdmil43zuuiwhex6nkhrqljqvtwblru",
    "examples/diloco.toml": "bafyreiaz65pai3i75nv3uepqqhvya6pk3kzrnemjsyjyc5t2o5dxznwolq",
    "examples/elastic.toml": "bafyreicy3yxkq2jyrkibia44jf5dun6xkycmdo6ghx5opsfqaxywjg6joa",
    "examples/llama-small.toml": "bafyreiffbjcnnxnwnxkgksa45mv46k2yfefi5anqpim65f2julrzafsc5a",
    "examples/slow-link.toml": "bafyreibrom4ny5u7izsq7latbfhzygi3sdc4b2epsbly2y6oj6tjegucte",
    "examples/tiny.toml": "bafyreida756rglcggamzq3vtvdwi4fjudnzkhexcu5qieg2syp5oaff7jy",
    "llama_full": "bafyreicwiiqwlpmuzi2rsbtnnhhe6amzen46f2pmtdiuxjz4o4eahyi6zi",
    "llama_tied": "bafyreiewgbimc6ttr5bafqds5cgtkh7662c7igaqgac2a2dhcvvl3jbela",
    "gpt_newer": "bafyreifoev36cpccoo7nygjtkjseo5votzbsm5juvcce5upxtzrwqxjnwu",
    "sync_explicit": "bafyreibjlzuelp7ytmjfavomppblm7avgnzmaxuvv4rh7nfynp2djprxka",
    "partial_default": "bafyreignfhipy2u6ftfodkt6tejbneelwovyyvvmaawvmktwjzxj3bkgni",
    "partial_full": "bafyreiadxovm6gn4ujr22x6ep7d6a3lidityp5t3kngr54iyduztnlo6wq",
    "partial_alpha0": "bafyreiemgpdiqrqkodjxmua4lacm7odrikorrtzkustesjshobbm47fdsq",
    "eager": "bafyreigsyw52q4oqqdrlsyl544hg5zrbvxlj7et2spvbxlsg3qjljfuyeq",
    "restart": "bafyreid3hbp5m4gcohgzlqelqdtzajdjfx5qnmhg4k2kauno34jhq436va",
    "parallel_set": "bafyreignjlobh2mpffrmhmu77hkwz4wxhs7d3ygrgm6ulujtgppyt2akgq",
    "parallel_minR": "bafyreicl2opzx5x5zjkwyiu3yn4txnleejcvud73da2r7pyn2id6znfd24",
    "sparse": "bafyreiahd47hgxdygjba36dgm55nrhv4l6regavss2b57s747vr3anpv3u",
    "gaps": "bafyreibyyb3lgkwu524tegdq5u3rqqnz6xqssofa5iw54qj2bciji3bfpe",
    "lowrank": "bafyreic45zauwvarfrixywjcv4yo4wke4zkoq5ylqbe4ayqyy6zx5h2wj4",
    "data_bpe": "bafyreigzzwtl4lxhblsx2d6dne7edc4we3d7b52znrvbyqoqwzzfzf7dn4",
    "arithmetic_float32": "bafyreigmpxm3nputul54kbn4x3wvcg4iwy3h5mggqvzgomrijmgqfqzshu",
}

#: Jobs (patches of BASE) that use each setting whose default a dump leaves out.
VARIANTS = {
    "llama_full": {"model": {"family": "llama", "n_kv_heads": 2, "intermediate_size": 128, "rope_theta": 5e5,
                             "rms_norm_eps": 1e-6, "qkv_bias": True, "dtype": "bfloat16"}},
    "llama_tied": {"model": {"family": "llama", "tie_embeddings": True}, "parallel": {"stages": 1, "microbatches": 4}},
    "gpt_newer": {"model": {"family": "gpt", "dtype": "bfloat16", "activation_checkpointing": True, "mlp_ratio": 2,
                            "dropout": 0.1}},
    "sync_explicit": {"outer": {"delay": 0, "lr": 0.5, "momentum": 0.8, "nesterov": False}},
    "partial_default": {"outer": {"delay": 1}},
    "partial_full": {"outer": {"delay": 1, "overlap": "partial", "tau": 2, "alpha": 0.5, "fragments": 2}},
    "partial_alpha0": {"outer": {"delay": 1, "tau": 0, "alpha": 0.0}},
    "eager": {"outer": {"delay": 1, "overlap": "eager"}},
    "restart": {"outer": {"delay": 1, "overlap": "restart"}},
    "parallel_set": {"parallel": {"device": "cpu", "min_replicas": 1, "numerics": "portable"}},
    "parallel_minR": {"parallel": {"min_replicas": 2}},
    "sparse": {"outer": {"compression": {"kind": "sparse", "density": 0.1, "chunk": 256, "bits": 4}}},
    "gaps": {"outer": {"compression": {"kind": "quantize", "bits": 2, "coding": "gaps"}}},
    "lowrank": {"outer": {"compression": {"kind": "lowrank", "rank": 8, "density": 0.5}}},
    "data_bpe": {"data": {"tokenizer": "bpe", "text_field": "body"}, "model": {"vocab_size": 512}},
}


@pytest.mark.parametrize("name", sorted(n for n in PINNED if n.startswith("examples/")))
def test_each_example_job_records_what_it_recorded_before_the_unions(name: str) -> None:
    job = load_job_file(ROOT / name)
    assert recorded_cid(job) == PINNED[name]
    dump = job.training_config().model_dump(mode="json")
    assert load_job(dump).model_dump(mode="json") == dump  # the record reads back to itself


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_newer_setting_records_what_it_recorded_before_the_unions(name: str) -> None:
    job = load_job(job_dict(**VARIANTS[name]))
    assert recorded_cid(job) == PINNED[name]
    dump = job.model_dump(mode="json")
    assert load_job(dump).model_dump(mode="json") == dump  # the record reads back to itself


def test_a_record_from_before_the_outer_arithmetic_reads_and_redumps_as_it_was() -> None:
    job = JobConfig.model_validate(job_dict(outer={"arithmetic": "float32"}))
    assert recorded_cid(job) == PINNED["arithmetic_float32"]
    record = RunConfig(job={k: v for k, v in job.model_dump(mode="json").items()}, code=b"")
    assert "arithmetic" not in record.job["outer"] and record.training_job() == job


# --- [model]: GptConfig | LlamaConfig on `family` ----------------------------------------

LLAMA_ONLY = {"n_kv_heads": 2, "intermediate_size": 256, "rope_theta": 5e5, "rms_norm_eps": 1e-6,
              "qkv_bias": True, "tie_embeddings": True}
GPT_ONLY = {"mlp_ratio": 2, "dropout": 0.1}


def test_the_family_fields_are_exactly_the_forms_own() -> None:
    common = set(ModelConfig.model_fields)
    assert set(LlamaConfig.model_fields) - common == {*LLAMA_ONLY, "init"}
    assert set(GptConfig.model_fields) - common == set(GPT_ONLY)


@pytest.mark.parametrize("key", sorted(LLAMA_ONLY))
@pytest.mark.parametrize("default", [False, True])
def test_a_gpt_model_with_a_llama_field_is_refused_naming_it(key: str, default: bool) -> None:
    value = LlamaConfig.model_fields[key].default if default else LLAMA_ONLY[key]
    message = refusal(job_dict(model={key: value}))  # even at llama's default: not a gpt key
    assert message == f"model: {key} is not a field of the gpt family"
    assert refusal(job_dict(model={"family": "gpt", key: value, "d_model": 0})).startswith(
        f"model: {key} is not a field of the gpt family; model.d_model:")  # the unknown key first


def test_a_gpt_model_with_an_init_directory_is_refused_naming_it() -> None:
    assert refusal(job_dict(model={"init": "some/dir"})) == "model: init (a Hugging Face directory) needs family = 'llama'"


@pytest.mark.parametrize("key", sorted(GPT_ONLY))
def test_a_llama_model_with_a_gpt_field_is_refused_naming_it(key: str) -> None:
    message = refusal(job_dict(model={"family": "llama", key: GPT_ONLY[key]}))
    assert message == f"model: {key} is not a field of the llama family"


@pytest.mark.parametrize(("family", "expected"), [
    ("mistral", "model.family: Input should be 'gpt' or 'llama' (got \"mistral\")"),
    (1, "model.family: Input should be 'gpt' or 'llama' (got 1)"),
])
def test_an_unknown_family_is_named(family: object, expected: str) -> None:
    assert refusal(job_dict(model={"family": family})) == expected


def test_a_key_of_no_family_is_an_unknown_key_with_its_near_miss() -> None:
    assert refusal(job_dict(model={"family": "llama", "rope_thta": 1.0})) == \
        "model.rope_thta: unknown key (did you mean rope_theta?)"
    assert refusal(job_dict(model={"mlp_ration": 2})) == "model.mlp_ration: unknown key (did you mean mlp_ratio?)"
    assert refusal(job_dict(outer={"fragmets": 2})) == "outer.fragmets: unknown key (did you mean fragments?)"


def test_model_config_gives_the_familys_class() -> None:
    assert type(ModelConfig(d_model=64)) is GptConfig and type(ModelConfig.model_validate({})) is GptConfig
    llama = ModelConfig(family="llama", n_kv_heads=2)
    assert type(llama) is LlamaConfig and llama.kv_heads == 2 and llama == LlamaConfig(family="llama", n_kv_heads=2)
    assert type(load_job(job_dict(model={"family": "llama"})).model) is LlamaConfig
    with pytest.raises(ValidationError) as info:
        ModelConfig.model_validate({"family": "llama", "mlp_ratio": 2, "n_heads": 0})
    assert one_line(info.value, "model", ModelConfig) == \
        "model: mlp_ratio is not a field of the llama family; model.n_heads: Input should be greater than or equal to 1 (got 0)"


# --- [outer]: the exchange rule, on `delay` and `overlap` --------------------------------

RULES = {"sync": {}, "partial": {"delay": 1}, "eager": {"delay": 1, "overlap": "eager"},
         "restart": {"delay": 1, "overlap": "restart"}}
FORMS = {"sync": SyncOuter, "partial": PartialOuter, "eager": EagerOuter, "restart": RestartOuter}
OWN = {"overlap": "partial", "tau": 2, "alpha": 0.5, "fragments": 2}  # a value of each rule-only key


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_is_its_own_class(rule: str) -> None:
    job = load_job(job_dict(outer=RULES[rule]))
    assert type(job.outer) is FORMS[rule] and job.outer.rule == rule
    assert type(OuterConfig(steps=1, inner_steps=1, **RULES[rule])) is FORMS[rule]
    if rule != "partial":  # the partial rule's settings read as "none" on the others
        assert (job.outer.tau, job.outer.alpha, job.outer.fragments) == ("auto", None, 1)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("key", sorted(OWN))
def test_each_rule_with_another_rules_setting_is_refused_naming_it(rule: str, key: str) -> None:
    if key in FORMS[rule].model_fields:
        return  # its own setting
    message = refusal(job_dict(outer={**RULES[rule], key: OWN[key]}))
    if rule == "sync":
        assert message == f"outer: {key} needs delay = 1 (an overlapped exchange); delay = 0 is synchronous"
    else:
        assert message == f'outer: {key} is a setting of overlap = "partial" (overlap is "{rule}")'


def test_the_rule_only_keys_are_refused_where_they_do_not_belong() -> None:
    own = {rule: {k for k in OWN if k in form.model_fields} for rule, form in FORMS.items()}
    assert own == {"sync": set(), "partial": set(OWN), "eager": {"overlap"}, "restart": {"overlap"}}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_typo_under_outer_is_named_as_an_unknown_key_under_every_rule(rule: str) -> None:
    data = job_dict(outer=RULES[rule])
    data["outer"]["inner_step"] = data["outer"].pop("inner_steps")
    assert refusal(data) == "outer.inner_step: unknown key (did you mean inner_steps?); outer.inner_steps: Field required"


@pytest.mark.parametrize(("outer", "expected"), [
    ({"delay": 2}, "outer.delay: must be 0 or 1 (got 2)"),
    ({"delay": True}, "outer.delay: Input should be a valid integer (got true)"),
    ({"delay": "1"}, 'outer.delay: Input should be a valid integer (got "1")'),
    ({"delay": 1, "overlap": "lazy"}, "outer.overlap: Input should be 'partial', 'eager' or 'restart' (got \"lazy\")"),
    ({"delay": 1, "overlap": "eager", "compression": {"bits": 3}}, "outer.compression.bits: must be one of 1, 2, 4, 8 (got 3)"),
    ({"delay": 1, "tau": 9}, "outer: tau (9) must be in [0, inner_steps = 8]"),
])
def test_a_bad_rule_or_a_rules_bad_value_is_named(outer: dict, expected: str) -> None:
    assert refusal(job_dict(outer=outer)) == expected
