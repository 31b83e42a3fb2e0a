"""`rtrl model`: base models for the policy (local directories; nothing comes from a hub)."""

from __future__ import annotations

import click

from pipeline.cli.common import CONTEXT_SETTINGS
from train.models import TINY_ARCHS, ModelError, init_tiny, load_policy
from train.tiny_tokenizers import TOKENIZERS


@click.group(context_settings=CONTEXT_SETTINGS)
def model() -> None:
    """Base models: any local Hugging Face causal LM directory, or a tiny one made here."""


@model.command("init-tiny")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--arch", type=click.Choice(TINY_ARCHS), default="llama", show_default=True)
@click.option("--hidden", default=64, show_default=True, help="Hidden size.")
@click.option("--layers", default=2, show_default=True, help="Transformer layers.")
@click.option("--heads", default=4, show_default=True, help="Attention heads (must divide --hidden).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random initialisation (and the BPE's text).")
@click.option(
    "--tokenizer",
    type=click.Choice(TOKENIZERS),
    default="char",
    show_default=True,
    help="char: one token per character (the demo); bpe: a byte-level BPE trained here, with a "
    "ChatML chat template for system/user/assistant/tool turns and tool calls (Qwen2.5 convention).",
)
@click.option("--vocab", default=32_768, show_default=True, help="Vocabulary size of --tokenizer bpe.")
def init_tiny_cmd(
    out: str, arch: str, hidden: int, layers: int, heads: int, seed: int, tokenizer: str, vocab: int
) -> None:
    """Make a small randomly initialised causal LM and its tokenizer, from a config (no download):
    for tests and the demo. It loads like a downloaded model (AutoTokenizer, AutoModelForCausalLM).
    Same seed, same weights and merges."""
    try:
        path = init_tiny(
            out, arch=arch, hidden=hidden, layers=layers, heads=heads, seed=seed, tokenizer=tokenizer, vocab=vocab
        )
    except ModelError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote a tiny {arch} model with a {tokenizer} tokenizer to {path}")


@model.command()
@click.argument("path", type=click.Path())
def show(path: str) -> None:
    """Load a local model directory and print what it is (a quick check before training)."""
    try:
        policy = load_policy(path)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from None
    cfg = policy.model.config
    params = sum(p.numel() for p in policy.model.parameters())
    click.echo(
        f"{path}: {cfg.model_type}, {params:,} parameters, {cfg.num_hidden_layers} layers, "
        f"vocab {cfg.vocab_size}, on {policy.device} as {policy.model.dtype}, revision {policy.revision}"
    )
