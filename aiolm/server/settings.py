"""Server settings: one argparse definition for ``aiolm serve`` and for ``create_app()``.

``create_app()`` (used by ``uvicorn --factory``, hypercorn, granian) has no command
line of its own, so it reads the same flags from the environment:

- ``AIOLM_CONFIG``: a JSON (or TOML) file whose keys are flag names
  (``{"max_model_len": 1024, "api_key": "..."}``),
- ``AIOLM_ARGS``: a string of flags, exactly as given to ``aiolm serve``,
- ``AIOLM_MODEL``, ``AIOLM_API_KEY``, ``AIOLM_ALLOWED_ORIGINS``: the common ones.

Later sources win: config file < AIOLM_ARGS < the single-purpose variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiolm.config import SERVE_MAX_WAITING, CliParser, EngineArgs, int_in
from aiolm.server.protocol import Limits
from aiolm.server.reasoning import FORMATS as REASONING_FORMATS
from aiolm.server.tool_parsers import PARSERS


@dataclass
class ServerSettings:
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    max_request_bytes: int = 8 << 20
    max_n: int = 16
    max_prompts: int = 64
    shutdown_timeout: float = 30.0
    access_log: bool = True
    web_ui: bool = True
    # Reliability (docs/reliability.md): what one client may ask for and how long it may take.
    max_seqs_per_request: int = 64  # prompts x n of one HTTP request
    # the most sequences one engine (a data-parallel replica) holds at once, running seats and
    # waiting room, and the replicas: a request that needs more can never be admitted; None: the
    # waiting room is unbounded
    max_live_seqs: int | None = None
    replicas: int = 1
    allow_request_priority: bool = False
    body_timeout: float = 30.0  # seconds for a whole request body to arrive
    request_timeout: float = 0.0  # default per-request timeout in seconds (0 = none)
    exit_on_engine_death: bool = False  # `aiolm serve` turns it on
    lenient_fields: bool = False
    tool_call_parser: str | None = None  # tool_choice 'auto': aiolm/server/tool_parsers
    reasoning_parser: str | None = None  # thinking split from content: aiolm/server/reasoning.py
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    max_logprobs: int = EngineArgs.max_logprobs  # the engine's flag, so the API's bounds match it

    @property
    def limits(self) -> Limits:
        return Limits(
            max_n=self.max_n, max_prompts=self.max_prompts, max_logprobs=self.max_logprobs, lenient=self.lenient_fields
        )


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds >= 0")
    return value


def _origins(v: str) -> list[str]:
    """Comma-separated origins, or vLLM's JSON list (taken as one origin, it matched none)."""
    if v.lstrip().startswith("["):
        try:
            given = json.loads(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v!r} is not a JSON list of origins") from None
        if not (isinstance(given, list) and all(isinstance(o, str) for o in given)):
            raise argparse.ArgumentTypeError(f"{v!r} is not a JSON list of origins")
        return [o.strip() for o in given if o.strip()]
    return [o.strip() for o in v.split(",") if o.strip()]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP-side flags (the engine's come from EngineArgs.add_cli_args)."""
    d = ServerSettings()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int_in(1, 65535), default=8000, help="port to listen on")
    g.add_argument(
        "--api-key",
        default=os.environ.get("AIOLM_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' (also AIOLM_API_KEY); /health and /metrics stay open",
    )
    g.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        help="CORS origins, comma-separated or vLLM's JSON list ('*' for any); none by default",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int_in(1),
        default=d.max_request_bytes,
        help="largest request body accepted (413 above)",
    )
    g.add_argument("--max-n", type=int_in(1), default=d.max_n, help="largest 'n' (choices per request)")
    g.add_argument(
        "--max-prompts", type=int_in(1), default=d.max_prompts, help="most prompts in one /v1/completions request"
    )
    g.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=d.shutdown_timeout,
        help=(
            "seconds in-flight requests may finish after SIGTERM; then they are aborted, a stream "
            "ending with a 'shutting_down' error event and a waiting client with a 503"
        ),
    )
    g.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one JSON line per HTTP request on the 'aiolm.access' logger",
    )
    g.add_argument(
        "--web-ui",
        action=argparse.BooleanOptionalAction,
        default=d.web_ui,
        help="serve the chat page at / (static files in aiolm/server/web)",
    )
    g.add_argument(
        "--lenient-fields",
        action="store_true",
        default=d.lenient_fields,
        help="log a warning for request fields the server does not implement instead of a 400",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="how to read tool calls in the model's free output (tool_choice 'auto'); "
        "hermes: <tool_call> JSON blocks (Qwen, Hermes), llama3_json: a JSON object, "
        "pythonic: [f(a=1), ...]",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_FORMATS),
        default=None,
        help="split a reasoning model's thinking from its answer (chat 'reasoning_content'); "
        "deepseek_r1 and qwen3: <think>...</think>, granite: Granite 3.2's thought and response markers",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --enable-lora: let clients load and unload adapters while the server runs "
        "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter); otherwise those answer 403",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="%(choices)s",
    )
    g.add_argument(
        "--max-seqs-per-request",
        type=int_in(1),
        default=d.max_seqs_per_request,
        help="most sequences (prompts x n) one HTTP request may start (400 above)",
    )
    g.add_argument(
        "--allow-request-priority",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="honour the 'priority' field of requests, lower values first (implies "
        "--scheduling-policy priority); otherwise a non-zero one is a 400",
    )
    g.add_argument(
        "--body-timeout",
        type=seconds,
        default=d.body_timeout,
        help="seconds a client may take to send a whole request body (408 after; 0 = no limit)",
    )
    g.add_argument(
        "--request-timeout",
        type=seconds,
        default=d.request_timeout,
        help="seconds a generation may run before it is aborted and its KV blocks freed (0 = no limit)",
    )
    g.add_argument(
        "--exit-on-engine-death",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop the server (exit status 1) once the engine is dead, so a supervisor "
        "restarts it; otherwise it stays up answering 503",
    )


def settings_from_namespace(ns: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        api_key=ns.api_key or None,
        allowed_origins=list(ns.allowed_origins or []),
        max_request_bytes=ns.max_request_bytes,
        max_n=ns.max_n,
        max_prompts=ns.max_prompts,
        shutdown_timeout=ns.shutdown_timeout,
        access_log=ns.access_log,
        web_ui=ns.web_ui,
        max_seqs_per_request=ns.max_seqs_per_request,
        max_live_seqs=(
            ns.max_num_seqs + ns.max_waiting_requests
            if getattr(ns, "max_waiting_requests", None) is not None and getattr(ns, "max_num_seqs", None)
            else None
        ),
        replicas=getattr(ns, "data_parallel_size", 1) or 1,
        allow_request_priority=ns.allow_request_priority,
        body_timeout=ns.body_timeout,
        request_timeout=ns.request_timeout,
        exit_on_engine_death=ns.exit_on_engine_death,
        lenient_fields=ns.lenient_fields,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        max_logprobs=ns.max_logprobs,
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
    )


def build_parser(prog: str = "aiolm serve") -> argparse.ArgumentParser:
    parser = CliParser(prog=prog, description="Serve the OpenAI-compatible API.")
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(max_waiting_requests=SERVE_MAX_WAITING)  # a server bounds its queue
    add_server_args(parser)
    return parser


def parse_serve_args(
    argv: list[str],
    parser: argparse.ArgumentParser | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> tuple[EngineArgs, ServerSettings, argparse.Namespace]:
    parser = parser or build_parser()
    # a config's settings are parsed as the flags they stand for (checked the same way), then
    # the command line into the same namespace: its flags win
    ns = parser.parse_args(_config_argv(parser, defaults)) if defaults else None
    ns = parser.parse_args(argv, namespace=ns)
    if ns.model_tag is not None:
        flagged = [a for a in argv if a == "--model" or a.startswith("--model=")]
        if flagged and ns.model != ns.model_tag:
            parser.error(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r}; give one")
        ns.model = ns.model_tag
    if ns.allow_request_priority:  # accepting priorities the FCFS queue ignores would be a silent no-op
        ns.scheduling_policy = "priority"
    elif ns.scheduling_policy == "priority":  # as vLLM's flag: the queue is ordered by the requests' priority
        ns.allow_request_priority = True
    try:
        engine_args = EngineArgs.from_namespace(ns)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    return engine_args, settings_from_namespace(ns), ns


def _config_argv(parser: argparse.ArgumentParser, config: Mapping[str, Any]) -> list[str]:
    """A config's settings as the command-line flags they stand for, so that each value is
    converted and range-checked as the flag's would be (set as defaults, "false" was a true
    string and 2.5 reached the workers as a count)."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    unknown = sorted(set(config) - set(actions))
    if unknown:
        raise SystemExit(f"unknown settings in the config: {', '.join(unknown)}")
    argv: list[str] = []
    for key, value in config.items():
        action = actions[key]
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if value is None:
            continue  # the flag's default
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
            if not isinstance(value, bool):
                raise SystemExit(f"config setting {key}: must be true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag.removeprefix("--"))
            elif value:
                argv.append(flag)
        elif action.nargs in ("+", "*"):
            values = value if isinstance(value, list) else [value]
            argv += [flag, *(v if isinstance(v, str) else json.dumps(v) for v in values)]
        else:  # --flag=value: a value may start with "-"
            if isinstance(value, list):  # vLLM's list form of a one-valued flag (served_model_name)
                if len(value) != 1:
                    raise SystemExit(f"config setting {key}: takes one value, got a list of {len(value)}")
                (value,) = value
            argv.append(f"{flag}={value if isinstance(value, str) else json.dumps(value)}")
    return argv


def _read_config(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SystemExit(f"AIOLM_CONFIG {path}: cannot read it ({e.strerror or e})") from None
    if p.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise SystemExit(f"{path}: TOML configs need Python 3.11+; use JSON") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SystemExit(f"AIOLM_CONFIG {path}: not valid TOML ({e})") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise SystemExit(f"AIOLM_CONFIG {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: the config must be an object of flag names")
    return {
        # allowed_origins may be a list there: its flag takes them comma-separated
        k.replace("-", "_"): (
            ",".join(map(str, v)) if k.replace("-", "_") == "allowed_origins" and isinstance(v, list) else v
        )
        for k, v in data.items()
    }


def from_environment(env: Mapping[str, str] | None = None) -> tuple[EngineArgs, ServerSettings]:
    """Settings for ``create_app()`` from AIOLM_* variables (see the module docstring)."""
    env = os.environ if env is None else env
    defaults = _read_config(env["AIOLM_CONFIG"]) if env.get("AIOLM_CONFIG") else {}
    try:
        argv = shlex.split(env.get("AIOLM_ARGS", ""))
    except ValueError as e:
        raise SystemExit(f"AIOLM_ARGS: {e}") from None
    # where and how to listen, and its log level, are the ASGI server's (uvicorn --port ...)
    theirs = [f for f in ("--host", "--port", "--log-level") if any(a.split("=")[0] == f for a in argv)]
    theirs += [f"{k} (AIOLM_CONFIG)" for k in ("host", "port", "log_level") if k in defaults]
    if theirs:
        raise SystemExit(
            f"{', '.join(theirs)}: the ASGI server's option, not the app's (uvicorn --host/--port/--log-level)"
        )
    for var, flag in (
        ("AIOLM_API_KEY", "--api-key"),
        ("AIOLM_ALLOWED_ORIGINS", "--allowed-origins"),
    ):
        if env.get(var):
            argv += [flag, env[var]]
    engine_args, settings, _ = parse_serve_args(argv, build_parser("create_app"), defaults)
    if env.get("AIOLM_MODEL"):  # it wins over AIOLM_ARGS, the model given there as MODEL included
        engine_args = dataclasses.replace(engine_args, model=env["AIOLM_MODEL"])
    return engine_args, settings
