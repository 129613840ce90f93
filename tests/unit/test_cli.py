"""The `longdoc` command line: every verb of docs/design.md is registered; `longdoc env` runs."""


def test_cli_env_and_help_list_every_verb(capsys):
    from longdoc.cli import build_parser, main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "cpu block kernel" in out
    verbs = set(build_parser()._subparsers._group_actions[0].choices)
    assert {"data", "train", "eval", "ask", "bench", "plan", "verify", "env"} <= verbs
