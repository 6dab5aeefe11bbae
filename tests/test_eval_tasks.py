"""Task prompts on real items, item metrics and GSM8K answer extraction."""

from __future__ import annotations

import pytest

from kvhandoff.errors import ConfigError
from kvhandoff_lab.evaluation import tasks as T
from kvhandoff_lab.evaluation.data import hf_rows


def test_item_counts_and_unique_ids():
    expected = {"arc_challenge": 299, "hellaswag": 10042, "winogrande": 1267, "mmlu": 14042, "gsm8k": 1319,
                "piqa": 1838, "boolq": 3270, "arc_easy": 570}
    for name, count in expected.items():
        items = T.load_items(name)
        assert len(items) == count
        assert len({i.id for i in items}) == count


def test_arc_prompt():
    item = T.load_items("arc_challenge")[0]
    assert item.id == "Mercury_SC_407695"
    assert {c.context for c in item.choices} == {
        "Question: Juan and LaKeisha roll a few objects down a ramp. They want to see which object rolls the "
        "farthest. What should they do so they can repeat their investigation?\nAnswer:"
    }
    assert [c.continuation for c in item.choices][3] == " Record the details of the investigation."
    assert item.gold == 3 and item.chance == 0.25
    assert item.choices[0].norm_length == len("Put the objects in groups.")
    # numeric answer keys ("1".."4") are mapped through the label list too
    numeric = [i for i in T.load_items("arc_challenge") if i.id == "Mercury_7103565"]
    assert numeric and 0 <= numeric[0].gold < len(numeric[0].choices)


def test_hellaswag_prompt_and_preprocessing():
    item = T.load_items("hellaswag")[0]
    assert item.choices[0].context == "Roof shingle removal: A man is sitting on a roof. He"
    assert item.choices[3].continuation == " starts pulling up roofing on a roof."
    assert item.gold == 3
    rows = hf_rows("hellaswag/none/validation")
    index = next(i for i, r in enumerate(rows) if "[title]" in r["ctx"])
    wikihow = T.load_items("hellaswag")[index]
    assert "[" not in wikihow.choices[0].context and "  " not in wikihow.choices[0].context
    assert T._hellaswag_preprocess(" a [title] b [step] c  d ") == "a. b c d"


def test_winogrande_partial_evaluation():
    item = T.load_items("winogrande")[0]
    contexts = [c.context for c in item.choices]
    assert contexts == ["Sarah was a much better surgeon than Maria so Sarah",
                        "Sarah was a much better surgeon than Maria so Maria"]
    assert {c.continuation for c in item.choices} == {" always got the easier cases."}
    assert item.gold == 1 and T.TASKS["winogrande"].metrics == ("acc",)


def test_piqa_and_boolq_prompts():
    piqa = T.load_items("piqa")[0]
    assert piqa.choices[0].context == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert piqa.gold == 0 and len(piqa.choices) == 2
    boolq = T.load_items("boolq")[0]
    assert boolq.choices[0].context.endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert [c.continuation for c in boolq.choices] == [" no", " yes"] and boolq.gold == 0


def test_mmlu_five_shot_from_dev_split():
    item = T.load_items("mmlu")[0]
    assert item.id == "mmlu-abstract_algebra-0"
    context = item.choices[0].context
    assert context.startswith(
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\nA. 0\nB. 1\nC. 2\nD. 3\nAnswer: B\n\n"
    )
    assert context.count("\nAnswer:") == 6  # five exemplars + the question
    dev = hf_rows("hails/mmlu_no_train/abstract_algebra/dev")
    assert all(r["question"].strip() in context for r in dev)
    assert context.endswith("\nD. 6\nAnswer:")
    assert [c.continuation for c in item.choices] == [" A", " B", " C", " D"]
    assert all(c.norm_length == 1 for c in item.choices)
    test_rows = hf_rows("hails/mmlu_no_train/abstract_algebra/test")
    assert item.gold == test_rows[0]["answer"]
    # the 5-shot block is the item's shared prefix: one string per subject
    assert item.shared_prefix == T.mmlu_prefix("abstract_algebra", list(dev))
    assert context == item.shared_prefix + T._mmlu_question(test_rows[0])


def test_gsm8k_eight_shot_cot_prompt():
    item = T.load_items("gsm8k")[0]
    assert item.context.startswith("Q: There are 15 trees in the grove.")
    assert item.context.count("\nA:") == 9 and item.context.count("The answer is") == 8
    assert "So the answer is" not in item.context and "Question:" not in item.context
    assert item.context.endswith("How much in dollars does she make every day at the farmers' market?\nA:")
    assert item.answer == "18" and item.stop == T.GSM8K_STOP and item.chance == 0.0
    assert item.shared_prefix.count("The answer is") == 8 and item.shared_prefix.endswith(".\n\n")
    assert item.context == item.shared_prefix + "Q: " + item.context.rsplit("Q: ", 1)[1]


@pytest.mark.parametrize(
    ("output", "flexible", "strict"),
    [
        ("She sells 9 eggs for $2 each, 9 * 2 = 18. The answer is 18.", "18.", "18"),
        ("Total is $1,234. The answer is 1,234.\n", "1,234.", "1,234"),
        ("It loses 5 degrees, so -5 it is.", "-5", T.INVALID),
        ("no digits here", T.INVALID, T.INVALID),
        ("The answer is 7", "7", T.INVALID),  # strict needs the trailing character
    ],
)
def test_gsm8k_extraction(output, flexible, strict):
    assert T.extract_gsm8k_answer(output, "flexible") == flexible
    assert T.extract_gsm8k_answer(output, "strict") == strict


def test_gsm8k_exact_match_normalisation():
    assert T.gsm8k_exact_match("18.", "18") == 1.0
    assert T.gsm8k_exact_match("$1,234", "1234") == 1.0
    assert T.gsm8k_exact_match("17", "18") == 0.0
    assert T.gsm8k_exact_match(T.INVALID, "18") == 0.0
    assert T.gsm8k_gold("Janet sells 9 eggs.\n#### 1,080") == "1,080"
    record = {"output": " 9 * 2 = 18. The answer is 18.\n", "gold": "18"}
    assert T.gen_item_metrics(record) == {"exact_match": 1.0, "exact_match_strict": 1.0}
    record = {"output": " 9 * 2 = 18 dollars", "gold": "18"}  # the last number counts; no "The answer is"
    assert T.gen_item_metrics(record) == {"exact_match": 1.0, "exact_match_strict": 0.0}
    record = {"output": " 18 eggs, 2 left", "gold": "18"}
    assert T.gen_item_metrics(record)["exact_match"] == 0.0
    # the model ended the document: what follows its end-of-text token is not its answer
    record = {"output": " The answer is 112.<|endoftext|>Human: A man has 1500 dollars", "gold": "112"}
    assert T.gen_item_metrics(record) == {"exact_match": 1.0, "exact_match_strict": 1.0}
    assert T.until_end_of_text(" a<|im_end|> b<|endoftext|>") == " a" and T.until_end_of_text(" a b") == " a b"
    assert T.cut_at_stop("12. The answer is 3.\n\nQ: next", ("Q:", "\n\n")) == ("12. The answer is 3.", True)
    with pytest.raises(ConfigError):
        T.extract_gsm8k_answer("1", "loose")


def test_mc_metrics_acc_and_length_normalised():
    # choice 0 has the best raw log-likelihood, choice 1 the best per character
    record = {"loglikelihoods": [-10.0, -12.0, -30.0], "norm_lengths": [5, 20, 10], "gold": 1}
    assert T.mc_item_metrics(record) == {"acc": 0.0, "acc_norm": 1.0}
    assert T.mc_choice_scores(record, "acc_norm").tolist() == [-2.0, -0.6, -3.0]
    with pytest.raises(ConfigError, match="acc_norm"):
        T.mc_choice_scores(record, "f1")
    spec = T.TASKS["boolq"]
    assert T.item_metrics(spec, record) == {"acc": 0.0}


def test_parse_tasks():
    assert T.parse_tasks("core") == list(T.CORE_TASKS)
    assert T.parse_tasks("heldout,arc-easy,piqa") == ["piqa", "boolq", "arc_easy"]
    assert T.parse_tasks("all") == list(T.CORE_TASKS + T.HELDOUT_TASKS)
    assert T.parse_tasks("mmlu,perplexity", extra=("perplexity",)) == ["mmlu", "perplexity"]
    assert T.SWEEP_TASKS == ("arc_challenge", "hellaswag", "winogrande", "mmlu")
    with pytest.raises(ConfigError, match="unknown task"):
        T.parse_tasks("core,squad")
    with pytest.raises(ConfigError):
        T.parse_tasks(" , ")


def test_shared_prefixes_of_the_few_shot_tasks():
    mmlu = T.load_items("mmlu")
    by_subject: dict[str, set[str]] = {}
    for item in mmlu:
        assert all(c.context.startswith(item.shared_prefix) for c in item.choices)
        by_subject.setdefault(item.id.rsplit("-", 1)[0], set()).add(item.shared_prefix)
    assert len(by_subject) == 57 and all(len(prefixes) == 1 for prefixes in by_subject.values())
    assert len(set().union(*by_subject.values())) == 57
    assert len({item.shared_prefix for item in T.load_items("gsm8k")}) == 1
    for name in ("arc_challenge", "hellaswag", "winogrande", "piqa", "boolq", "arc_easy"):
        assert all(item.shared_prefix is None for item in T.load_items(name)[:50])


def test_shared_prefix_must_start_every_context():
    choices = (T.Choice("Shots. Q?", " a", 1), T.Choice("Shots. Q?", " b", 1))
    assert T.MCItem("x", choices, 0, shared_prefix="Shots. ").shared_prefix == "Shots. "
    with pytest.raises(ConfigError, match="shared_prefix"):
        T.MCItem("x", choices, 0, shared_prefix="Other. ")
    with pytest.raises(ConfigError, match="shared_prefix"):
        T.GenItem("g", "Q: 1?\nA:", "1", shared_prefix="Q: 2")


def test_mmlu_dev_examples_are_validation_items_in_the_task_layout():
    from conftest import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    examples = T.mmlu_dev_examples(tokenizer, 3)
    assert len(examples) == 3
    prompt, answer = examples[0]
    text = tokenizer.decode(prompt)
    row = hf_rows("hails/mmlu_no_train/abstract_algebra/validation")[0]
    assert text == T.mmlu_prefix("abstract_algebra", list(hf_rows("hails/mmlu_no_train/abstract_algebra/dev"))) + \
        T._mmlu_question(row)
    assert tokenizer.decode(answer) == " " + T.MMLU_LETTERS[int(row["answer"])]
    # never a reported (test-split) item
    test_questions = {r["question"] for r in hf_rows("hails/mmlu_no_train/abstract_algebra/test")}
    assert row["question"] not in test_questions
    with pytest.raises(ConfigError, match="count"):
        T.mmlu_dev_examples(tokenizer, 0)


def test_gsm8k_worked_answer_is_in_the_exemplars_layout():
    answer = "She sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert T.gsm8k_worked_answer(answer) == "She sold 48/2 = 24 clips in May. She sold 48+24 = 72 clips. " \
        "The answer is 72."
    assert T.extract_gsm8k_answer(T.gsm8k_worked_answer(answer), "strict") == "72"


def test_gsm8k_dev_examples_come_from_the_dev_pool_only():
    from conftest import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    examples = T.gsm8k_dev_examples(tokenizer, 2)
    dev = [i for i in T.load_items("gsm8k") if T.pool_of("gsm8k", i.id) == "dev"]
    assert len(examples) == 2 and 200 < len(dev) < 330  # one item in five
    for (prompt, solution), item in zip(examples, dev, strict=False):
        assert tokenizer.decode(prompt) == item.context  # the reported task's 8-shot prompt
        worked = tokenizer.decode(solution)
        assert worked.startswith(" ") and worked.endswith(f" The answer is {item.answer}.")
    with pytest.raises(ConfigError, match="count"):
        T.gsm8k_dev_examples(tokenizer, len(dev) + 1)


def test_zeroshot_dev_examples_are_gold_choices_of_dev_pool_items():
    from conftest import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    examples = T.zeroshot_dev_examples(tokenizer, 2)
    assert len(examples) == 3 * 2
    for task, (context, continuation) in zip(("arc_challenge",) * 2 + ("hellaswag",) * 2 + ("winogrande",) * 2,
                                             examples, strict=True):
        dev = [i for i in T.load_items(task) if T.pool_of(task, i.id) == "dev"]
        text = tokenizer.decode(context) + tokenizer.decode(continuation)
        gold = [item.choices[item.gold] for item in dev[:2]]
        assert text in {g.context + g.continuation for g in gold}  # the gold choice of a dev-pool item
    with pytest.raises(ConfigError, match="count"):
        T.zeroshot_dev_examples(tokenizer, 0)
