"""Commands that write files or values: ``make-model`` (the tiny local model), ``k8s`` (a pools
file's Kubernetes manifests) and ``secret`` (a deployment secret)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from lmcache_pd.auth import SECRET_ENV, Role, generate_secret, role_shares
from lmcache_pd.cli.common import app, setup_logging
from lmcache_pd.deploy.pools import load_pools


@app.command("make-model")
def make_model_command(
    directory: Annotated[Path, typer.Argument(help="the Hugging Face folder to write")],
    seed: Annotated[int, typer.Option(help="seeds the random weights")] = 0,
    force: Annotated[bool, typer.Option(help="rebuild even if this build is there")] = False,
    architecture: Annotated[
        str, typer.Option(help="llama (grouped-query attention) or mla (a DeepSeek-V2)")
    ] = "llama",
    lora: Annotated[
        Path | None, typer.Option(help="also write a LoRA adapter for the llama into this folder")
    ] = None,
    vision: Annotated[
        Path | None,
        typer.Option(help="also write a tiny vision-language model into this folder"),
    ] = None,
) -> None:
    """Write a tiny random model that vLLM serves offline here, and print its folder.

    A folder already holding this seed's build is kept unless --force. The mla model is served
    on CPU with --attention-backend CPU_MLA. The adapter (--lora) is served with vLLM's
    --enable-lora --max-lora-rank 8 --lora-modules NAME=FOLDER. The vision model (--vision, an
    Idefics3) reads images sent as chat content parts, each resized to 32x32, 16 image tokens."""
    from lmcache_pd.harness.model_maker import ARCHITECTURES, ensure_model, make_model

    if architecture not in ARCHITECTURES:
        raise typer.BadParameter(f"one of {', '.join(ARCHITECTURES)}", param_hint="--architecture")
    setup_logging("info")
    build = make_model if force else ensure_model
    built = build(directory, seed=seed, architecture=architecture)
    typer.echo(built)
    if lora is not None:
        from lmcache_pd.harness.lora_maker import make_lora

        if architecture != "llama":
            raise typer.BadParameter("an adapter is made for the llama only", param_hint="--lora")
        typer.echo(make_lora(lora, built))
    if vision is not None:
        from lmcache_pd.harness.vision_maker import ensure_vision_model, make_vision_model

        build_vision = make_vision_model if force else ensure_vision_model
        typer.echo(build_vision(vision, seed=seed))


@app.command()
def k8s(
    pools: Annotated[Path, typer.Argument(help="pools YAML")],
    output: Annotated[
        Path | None, typer.Option(help="write one file per object into this folder")
    ] = None,
) -> None:
    """Write the Kubernetes manifests of POOLS (its `kubernetes:` section says the image,
    namespace, names and model volume): decode and prefill as StatefulSets with headless
    Services, the proxy as a Deployment with a Service, their YAMLs as ConfigMaps, the
    instances' key and the deployment secret (both fresh each time) as a Secret, and the
    NetworkPolicies that keep the KV and vLLM ports to the pools' own pods. Printed as one YAML
    stream, or with --output one file per object; then `kubectl apply -f`."""
    from lmcache_pd.deploy.k8s import file_name, manifests, to_yaml
    from lmcache_pd.errors import ConfigError

    try:
        objects = manifests(load_pools(pools))
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="POOLS") from None
    if output is None:
        typer.echo(to_yaml(objects), nl=False)
        return
    output.mkdir(parents=True, exist_ok=True)
    for index, manifest in enumerate(objects):
        (output / file_name(index, manifest)).write_text(to_yaml([manifest]))
    typer.echo(f"{len(objects)} objects written to {output}", err=True)


if __name__ == "__main__":
    app()


@app.command()
def secret(
    share: Annotated[
        Role | None,
        typer.Option(help=f"print this role's share of ${SECRET_ENV} instead of a new secret"),
    ] = None,
) -> None:
    """Print a fresh deployment secret (for LMCACHE_PD_SECRET or a secret_file): every process
    of one deployment is given it, or its role's share of it (--share: prefill's connector is
    the producer, decode's the consumer); `serve` makes its own for the pools it starts."""
    if share is None:
        typer.echo(generate_secret())
        return
    whole = os.environ.get(SECRET_ENV, "")
    if not whole.strip():
        raise typer.BadParameter(f"set {SECRET_ENV} to the secret to share", param_hint="--share")
    typer.echo(role_shares(whole)[share])
