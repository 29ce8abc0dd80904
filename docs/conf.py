"""Sphinx configuration of the ignite-amp documentation: ``sphinx-build -W --keep-going docs docs/_build/html``."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

from ignite_amp.version import __version__  # noqa: E402

project = "ignite-amp"
author = "the ignite-amp developers"
copyright = "2026, the ignite-amp developers"
release = version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the Google-style "Args:" docstrings
    "myst_parser",  # the guides are Markdown
    "ignite_amp_docs",  # the generated references: public API, config keys, CLI
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Every internal link and cross-reference must resolve. Names of other projects (torch, Ignite, the
# standard library) are left unlinked: the build runs offline, so there is no intersphinx inventory.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(torch|ignite|typing|collections|pathlib|os|argparse|dataclasses|enum)(\..*)?"),
                        (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|object|type|callable|None|"
                                   r"Any|Callable|Iterable|Iterator|Mapping|Optional|Sequence|Tuple|Union|Dict|"
                                   r"List|Path|PathLike|Module|Tensor|Engine|Events|Metric|EventEnum|"
                                   r"Serializable|Exception|ValueError|TypeError|RuntimeError)"),
                        # the internal base of AmpStep and EvalStep: its members are shown on them
                        (r"py:class", r"ignite_amp\.step\.base\.StepBase"),
                        # TensorBoardMetrics' own part (its training scalars' window), read by tests and benchmarks
                        (r"py:class", r"ignite_amp\.handlers\.tensorboard\.scalars\.TrainWindow"),
                        # a config's sections (Config's fields): the config reference lists their keys
                        (r"py:class", r"ignite_amp\..*\.[A-Za-z0-9]+Config"),
                        # type variables (Section.replace's own type; AmpEngine's step, documented as data: older
                        # Sphinx looks an annotation of one up as a class)
                        (r"py:class", r"ignite_amp\.core\.config_values\.S|ignite_amp\.engine\.StepT")]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # "model_fn=call_model", not "<function call_model at 0x...>"
python_use_unqualified_type_names = True  # "Module", not "~torch.nn.modules.module.Module"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"ignite-amp {release}"
html_static_path = []
html_show_sourcelink = False
