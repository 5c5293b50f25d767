"""What launch/train.py reads, checked at start (before any process group): each a one-line error.

``check_inputs`` runs ``check_texts`` on the target and held-out files the run reads (a file
whose every text is whitespace would rank candidates against an empty target or evaluate
nothing) and ``check_init_from`` (launch/init_from.py); ``check_seq_len`` (launch/config.py,
run by ``load_run_config`` before the planner) compares ``--seq-len`` with the model's
positions.
"""

from __future__ import annotations

from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig, check_seq_len

__all__ = ["check_inputs", "check_seq_len", "check_texts"]


def check_texts(path: str, flag: str, rows: slice = slice(None)) -> None:
    """Raises: ConfigError: every text of the jsonl file ``path`` (given by ``flag``) that
    the run reads (``rows`` of its documents) is whitespace (InputFileError for a file that
    cannot be read, from the reader)."""
    from dattri_ds.data.corpus import load_documents

    every = load_documents(path)
    docs = every[rows]
    if not docs:  # the held-out part of a target file that has none left
        raise ConfigError(f"{flag} {path} holds {len(every)} documents, and --eval-every reads "
                          f"documents {rows.start}.. of it (the first --eval-skip "
                          f"{rows.start} are the selection target): none are left. Fix: pass "
                          f"--eval-data FILE.jsonl, or a smaller --eval-skip")
    if all(not d.text.strip() for d in docs):
        what = (f"the {len(docs)} texts it reads (documents {rows.start or 0}.."
                f"{(rows.start or 0) + len(docs) - 1}) are" if rows != slice(None) else
                "its only text is" if len(docs) == 1 else f"all {len(docs)} texts are")
        raise ConfigError(f"{flag} {path}: {what} whitespace, so there is nothing to compare "
                          f"with or evaluate. Fix: pass a jsonl file whose \"text\" fields "
                          f"hold the texts you care about")


def check_inputs(cfg: RunConfig) -> str | None:
    """The text and ``--init-from`` checks above (``load_run_config`` ran ``check_seq_len``);
    the ``--init-checkpoint`` tag to load (None: none).

    Raises:
        ConfigError: naming the flag, the value and the fix.
    """
    from dattri_ds.launch.init_from import check_init_from

    sc, tc = cfg.selection, cfg.train
    reads: list[tuple[str, str, slice]] = []  # what make_selector and make_evaluator read
    if sc.enabled and sc.target_data is not None and not sc.target_store:
        reads.append((sc.target_data, "--target-data", slice(0, sc.target_max_docs)))
    if tc.eval_every and tc.eval_data is not None:
        reads.append((tc.eval_data, "--eval-data", slice(0, tc.eval_max_docs)))
    elif tc.eval_every and sc.target_data is not None:  # held out from the target file
        reads.append((sc.target_data, "--target-data",
                      slice(tc.eval_skip, tc.eval_skip + tc.eval_max_docs)))
    if tc.eval_every and tc.general_eval_data is not None:
        reads.append((tc.general_eval_data, "--general-eval-data", slice(0, tc.eval_max_docs)))
    for path, flag, rows in reads:
        check_texts(path, flag, rows if rows != slice(0, None) else slice(None))
    return check_init_from(cfg)
