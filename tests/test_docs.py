"""The docs are part of the feature: their complete code examples run, and every public
function's docstring names each of its parameters."""
import inspect
import pathlib
import re

import pytest

import popxl_flash as pf

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "user-guide.md", ROOT / "docs" / "porting.md"]


MARKER = "<!-- runnable: tests/test_docs.py executes this block -->"


def complete_examples():
    """Python blocks marked runnable (whole programs; fragments and SDK-only sketches are not)."""
    for path in DOCS:
        blocks = re.findall(re.escape(MARKER) + r"\n```python\n(.*?)```", path.read_text(),
                            flags=re.S)
        for n, code in enumerate(blocks):
            yield pytest.param(code, id=f"{path.name}-{n}")


EXAMPLES = list(complete_examples())


def test_docs_have_runnable_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("code", EXAMPLES)
def test_doc_example_runs(code):
    namespace = {"__name__": "doc_example"}
    exec(compile(code, "<doc example>", "exec"), namespace)
    ir = namespace.get("ir")
    if ir is not None and not any(isinstance(v, pf.popxl.Session) for v in namespace.values()):
        pf.popxl.Session(ir, "ipu_model")  # graph-only examples must at least compile


PUBLIC_FUNCTIONS = [pf.flash_attention, pf.flash_attention_qkv_packed, pf.flash_attention_grad,
                    pf.flash_attention_qkv_packed_grad, pf.flash_attn_func, pf.reference.attention,
                    pf.reference.attention_grad, pf.plan, pf.called_graphs_grad_info,
                    pf.autodiff]


@pytest.mark.parametrize("fn", PUBLIC_FUNCTIONS, ids=lambda f: f.__name__)
def test_docstring_names_every_parameter(fn):
    doc = inspect.getdoc(fn)
    missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"\b{p}\b", doc)]
    assert not missing, f"{fn.__name__} docstring does not mention {missing}"
