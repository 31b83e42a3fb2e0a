"""`rtrl demo` (the whole loop on a laptop) and `rtrl sim` (the simulated fleet on its own)."""

from __future__ import annotations

import click

from pipeline.cli.common import CONTEXT_SETTINGS, Context, pass_ctx


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--cycles",
    default=5,
    show_default=True,
    help="Stop after this many cycles were decided (by the gate, or online for a canary).",
)
@click.option(
    "--task",
    type=click.Choice(["reverse", "agent"]),
    default="reverse",
    show_default=True,
    help="reverse: single answers (reverse a string); agent: episodes of tool calls and a final answer, "
    "rewarded by the episode's outcome.",
)
@click.option(
    "--naive-reward",
    is_flag=True,
    help="A reward spec blind to a hack (reverse: abstaining costs nothing; "
    "agent: a broken tool call costs nothing): watch the gate.",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--rate", default=24.0, show_default=True, help="Tasks per second the simulated users send.")
@click.option(
    "--every",
    default=None,
    help="Cycle interval (compressed schedule; default 45s, with --task agent 10s: "
    "its cycles wait for enough new episodes, not for the clock).",
)
@click.option(
    "--measure",
    default=200,
    show_default=True,
    help="After the last cycle, keep serving until the last champion has served this many requests.",
)
@click.option("--timeout", "timeout_s", default=900.0, show_default=True, help="Give up after this many seconds.")
@click.option("--verbose", is_flag=True, help="Show the structured logs here instead of writing them to a file.")
@click.option(
    "--gateway",
    is_flag=True,
    help="Put `rtrl gateway` in front of `rtrl serve`, as in front of vLLM: it "
    "captures the traffic and routes the canary's share.",
)
@pass_ctx
def demo(
    ctx: Context,
    cycles: int,
    task: str,
    naive_reward: bool,
    seed: int,
    rate: float,
    every: str | None,
    measure: int,
    timeout_s: float,
    verbose: bool,
    gateway: bool,
) -> None:
    """Run the whole loop on embedded defaults: a local Kafka, SQLite, a local MLflow store, a
    tiny base model, the policy server, the daemon and a simulated fleet; a candidate that passes
    the gate serves half the requests as the canary until the users' reactions decide its
    promotion -- then write a report (accept rate and reward per policy version, gate and online
    decisions) to <state>/demo/report
    (<state>/demo-naive/report with --naive-reward; <state>/demo-agent[-naive] with --task agent,
    whose report gives the episode success rate, calls per episode and the tool-call error rate
    per version). After the last cycle no further cycle runs
    while the last champion is measured (--measure), so its accept rate rests on enough requests.
    Its settings (the embedded defaults, the demo's, then your config file and RTRL_* variables)
    are written to <state>/demo/rtrl.toml, for the commands it prints at the end."""
    from pipeline.core.logs import quiet_progress_bars
    from pipeline.demo.report import canary_line, headline, routing
    from pipeline.demo.run import run_demo
    from pipeline.kafka_local import KafkaLocalError

    quiet_progress_bars()
    every = every or ("10s" if task == "agent" else "45s")
    try:
        report = run_demo(
            ctx.config.state_dir,
            ctx.config_path,
            cycles=cycles,
            naive=naive_reward,
            seed=seed,
            rate=rate,
            every=every,
            timeout_s=timeout_s,
            measure=measure,
            verbose=verbose,
            gateway=gateway,
            task=task,
        )
    except KafkaLocalError as exc:  # a port taken, no Java: the message says what to do
        raise click.ClickException(str(exc)) from None
    for v in report.versions:
        reward = "" if v["reward_mean"] is None else f", mean reward {v['reward_mean']:+.3f}"
        if task == "agent":
            click.echo(
                f"policy {v['version']:>4}: episode success rate {100 * v['accept_rate']:5.1f} % of "
                f"{v['served']} episodes, {v['calls_per_episode']:.2f} calls per episode, tool-call errors "
                f"{100 * v['tool_error_rate']:.1f} % of calls{reward}"
            )
        else:
            click.echo(
                f"policy {v['version']:>4}: accept rate {100 * v['accept_rate']:5.1f} % of {v['served']}{reward}"
            )
    click.echo(headline(report.versions, report.champion, task))
    click.echo(routing(report.served_by))
    click.echo(canary_line(report.canaries))
    click.echo(f"report: {', '.join(str(f) for f in report.files)}")
    if report.explore:  # (the first is `rtrl --config <the run's rtrl.toml> status`)
        stop = report.explore[0].rsplit(" ", 1)[0] + " kafka down"
        click.echo(f"the demo's Kafka broker keeps running for the commands below; `{stop}` stops it")
    click.echo("look around what it did:")
    for line in report.explore:
        click.echo(f"  {line}")


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The policy server (rtrl serve).")
@click.option("--rate", default=5.0, show_default=True, help="Tasks per second.")
@click.option("--seed", default=0, show_default=True)
@click.option("--duration", "duration_s", type=float, help="Seconds to run (default: until Ctrl-C).")
@click.option(
    "--task",
    type=click.Choice(["reverse", "agent"]),
    default="reverse",
    show_default=True,
    help="reverse: single answers; agent: episodes -- the users' tool calls run, results sent back, "
    "the episode's final answer judged (the server must serve a model that knows the lookup tool).",
)
@pass_ctx
def sim(ctx: Context, url: str, rate: float, seed: int, duration_s: float | None, task: str) -> None:
    """Simulated users: send reverse-a-string tasks to the server and react on the feedback
    topic with realistic delays (accept, edit, reject, persist, follow up; abstentions draw no
    complaint -- the reward-hacking bait). With --task agent, episodes: the user names a word by
    a key, the agent looks it up with a tool and answers; the product runs the tool calls, ends an
    episode at a broken call with an error result, and the users react to the final answer."""
    from deploy.serving.events import FEEDBACK_KEY, EventSender
    from pipeline.demo.fleet import make_fleet

    send = EventSender(ctx.config.kafka_access, ctx.config.kafka.feedback_topic, key=FEEDBACK_KEY)
    fleet = make_fleet(task, url, send, rate=rate, seed=seed)
    try:
        stats = fleet.run(duration_s=duration_s)
    except KeyboardInterrupt:
        stats = fleet.stats
    finally:
        send.close()
    click.echo(f"{stats.requests} requests ({stats.failed} failed), {stats.feedback} feedback events")
    for version, row in sorted(stats.by_version.items()):
        if task == "agent":
            episodes, succeeded, errors, calls = row
            click.echo(
                f"  policy {version}: episode success rate {100 * succeeded / episodes:.1f} % of {episodes}, "
                f"{calls / episodes:.2f} calls per episode, {errors} broken tool calls"
            )
        else:
            served, correct, abstained = row
            click.echo(
                f"  policy {version}: accept rate {100 * correct / served:.1f} % of {served}, abstained {abstained}"
            )


COMMANDS = [demo, sim]
