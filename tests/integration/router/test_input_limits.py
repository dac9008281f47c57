"""Input hardening, "every input a clear answer" and "limits before work", on real processes (a sim worker, routers
in front of it): every rejection is HTTP 4xx / gRPC INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for a message
over the transport's backstop, twice the method's bound) naming the field, decided by the router before it
tokenises, decodes or forwards; `resume_token_ids` are validated and never counted as generated; client
mistakes are logged without a traceback. (Timings and memory are `python -m kvmesh.bench oversize`'s, not
asserted here.)"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvmesh.core.sampling import N_MAX
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.sim_worker import BS

pytestmark = pytest.mark.integration
VOCAB = 500  # the routers' --vocab-size: ids the sim worker would accept, so a refusal is the router's own
MAX_PROMPT = 256  # the limited router's --max-prompt-tokens
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, sim_worker: ServiceProcess) -> Iterator[ServiceProcess]:
    """Default limits except the vocabulary; a short body timeout."""
    flags = ["--workers", sim_worker.address, "--block-size", str(BS), "--vocab-size", str(VOCAB)]
    sp = start_service("router", tmp_path_factory.mktemp("r"), *flags, "--http-body-timeout-s", "0.5", timeout=60)
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, sim_worker: ServiceProcess) -> Iterator[ServiceProcess]:
    """Small prompt limits: a 256-token prompt, 4 chat messages (gRPC messages up to ~1 MiB + the ids)."""
    flags = ["--workers", sim_worker.address, "--block-size", str(BS), "--vocab-size", str(VOCAB)]
    flags += ["--max-prompt-tokens", str(MAX_PROMPT), "--max-chat-messages", "4"]
    sp = start_service("router", tmp_path_factory.mktemp("s"), *flags, timeout=60)
    yield sp
    assert sp.terminate(timeout=30) == 0


def post(sp: ServiceProcess, body: object, chat: bool = False) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"http://127.0.0.1:{sp.http_port}{path}", content=content, timeout=30)


def param_of(r: httpx.Response) -> str | None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    return err["param"]  # type: ignore[no-any-return]


def generate(
    sp: ServiceProcess, req: router_pb2.RouterServiceGenerateRequest
) -> list[router_pb2.RouterServiceGenerateResponse]:
    with grpc.insecure_channel(sp.address) as ch:
        return list(router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=30))


def grpc_error(sp: ServiceProcess, req: router_pb2.RouterServiceGenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        generate(sp, req)
    return ei.value


def ids_req(ids: list[int], max_tokens: int = 4, **kw: object) -> router_pb2.RouterServiceGenerateRequest:
    return router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7),
        **kw,  # type: ignore[arg-type]
    )


HTTP_REFUSED = {
    "id-2**40": ({"prompt": [5, 2**40]}, "prompt"),  # was a 500: the wire's uint32 raised ValueError
    "id-beyond-vocab": ({"prompt": [5, VOCAB]}, "prompt"),  # was forwarded for the worker to refuse
    "one-element-list-beyond-vocab": ({"prompt": [[VOCAB + 1]]}, "prompt"),
    "stop-id-2**40": ({"prompt": [5], "stop_token_ids": [2**40]}, "stop_token_ids"),
    "stop-id-beyond-vocab": ({"prompt": [5], "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    "prompt-booleans": ({"prompt": [True, False]}, "prompt"),
    "lone-surrogate": (b'{"prompt": "x\\ud800y"}', "prompt"),
    "deep-json": (b"[" * 100_000 + b"]" * 100_000, "body"),
    "n-above-the-bound": ({"prompt": [5], "n": N_MAX + 1}, "n"),
    "logit-bias": ({"prompt": [5], "logit_bias": "nope"}, "logit_bias"),
}


@pytest.mark.parametrize(("body", "param"), list(HTTP_REFUSED.values()), ids=list(HTTP_REFUSED))
def test_http_inputs_get_a_400_naming_the_field(router: ServiceProcess, body: object, param: str) -> None:
    assert param_of(post(router, body)) == param


def test_http_oversize_prompt_refused_before_tokenising(router: ServiceProcess) -> None:
    """7.8 MB of text (under the 8 MiB body cap): over max_prompt_tokens x the longest token's characters, so
    refused without tokenising (the router tokenised it for 6.7 s before)."""
    r = post(router, {"prompt": "ab " * 2_600_000, "max_tokens": 2})
    assert param_of(r) == "prompt" and "characters > limit" in r.json()["error"]["message"]
    chat = post(router, {"messages": [{"role": "user", "content": "ab " * 2_600_000}]}, chat=True)
    assert param_of(chat) == "messages"
    assert "Traceback" not in router.log()


def test_http_body_shorter_than_content_length_gets_408(router: ServiceProcess) -> None:
    """A Content-Length larger than the body sent: 408 after --http-body-timeout-s, connection closed (it held
    the connection forever)."""
    with socket.create_connection(("127.0.0.1", router.http_port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b'Content-Length: 1000\r\n\r\n{"prompt": [5')
        got = b""
        while chunk := s.recv(65536):  # ends when the router closes the connection
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), got
    assert json.loads(body)["error"]["param"] == "body"


def test_grpc_garbage_bytes_are_invalid_argument(router: ServiceProcess, sim_worker: ServiceProcess) -> None:
    """Garbage and truncated protobuf bytes, to a streaming and a unary method of the router and to the worker:
    INVALID_ARGUMENT naming the request (it was UNKNOWN "Unexpected <class DecodeError>")."""
    valid = ids_req([5, 6, 7]).SerializeToString()
    cases = [
        (router.address, "/kvmesh.v1.RouterService/Generate", True, b"\xff\xff\xff\xff"),
        (router.address, "/kvmesh.v1.RouterService/Generate", True, valid[:-2]),
        (router.address, "/kvmesh.v1.RouterAdminService/ListWorkers", False, b"\x0a\xff"),
        (sim_worker.address, "/kvmesh.v1.WorkerService/Generate", True, b"\x12\x05\x0a"),
    ]
    for address, method, streaming, raw in cases:
        with grpc.insecure_channel(address) as ch:
            ident = {"request_serializer": None, "response_deserializer": None}
            with pytest.raises(grpc.RpcError) as ei:
                if streaming:
                    list(ch.unary_stream(method, **ident)(raw, timeout=30))
                else:
                    ch.unary_unary(method, **ident)(raw, timeout=30)
        err = ei.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw, err.details())
        assert "request" in (err.details() or "") and "decode" in (err.details() or ""), err.details()


def test_grpc_prompt_limits_before_work(small: ServiceProcess) -> None:
    """Over-long text is refused before tokenising; a message over the Generate bound (~1.1 MB here) before
    decoding, by its size, and one over the transport's backstop by grpc itself (20 MB was accepted and cost
    23.5 s and 2.5 GB); too many chat messages before rendering."""
    text = router_pb2.RouterServiceGenerateRequest(text="ab " * 20_000)  # > 256 tokens x the longest token
    err = grpc_error(small, text)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in (err.details() or "")
    over = grpc_error(small, router_pb2.RouterServiceGenerateRequest(text="a" * 1_500_000))
    assert over.code() == grpc.StatusCode.INVALID_ARGUMENT, over.details()
    assert "request" in (over.details() or "") and "1500004 bytes" in (over.details() or ""), over.details()
    huge = router_pb2.RouterServiceGenerateRequest(text="a" * 20_000_000)
    assert grpc_error(small, huge).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    chat = router_pb2.RouterServiceGenerateRequest(
        chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")] * 5)
    )
    err = grpc_error(small, chat)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in (err.details() or "")
    assert len(generate(small, ids_req([5] * MAX_PROMPT, 2))) >= 1  # at the limit: served


def test_grpc_token_ids_checked_against_the_vocabulary(router: ServiceProcess) -> None:
    for req, field in (
        (ids_req([5, VOCAB]), "prompt"),
        (ids_req([5], resume_token_ids=[7, VOCAB + 3]), "resume_token_ids"),
    ):
        err = grpc_error(router, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (err.details() or ""), err.details()
    stop = ids_req([5])
    stop.sampling.stop_token_ids.append(VOCAB)
    err = grpc_error(router, stop)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in (err.details() or "")


def test_resume_token_ids_bounded_and_not_counted_as_generated(router: ServiceProcess) -> None:
    """5 million resumed ids gave an instant finish reporting completion_tokens 5000000."""
    many = ids_req([5, 6, 7], 16, resume_token_ids=[9] * 5_000_000)
    err = grpc_error(router, many)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "resume_token_ids" in (err.details() or "")
    over = grpc_error(router, ids_req([5, 6, 7], 4, resume_token_ids=[9] * 5))
    assert over.code() == grpc.StatusCode.INVALID_ARGUMENT
    done = generate(router, ids_req([5, 6, 7], 4, resume_token_ids=[9] * 4))  # nothing owed
    assert done[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and done[-1].usage.completion_tokens == 0
    part = generate(router, ids_req([5, 6, 7], 6, resume_token_ids=[9] * 2))
    assert sum(len(m.token_ids) for m in part) == 4 and part[-1].usage.completion_tokens == 4


def test_grpc_penalties_out_of_range_are_refused(router: ServiceProcess) -> None:
    """Penalties cross the router to the worker now (they were dropped there): out of range, they are refused."""
    for field, value in (("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", -1.0)):
        req = ids_req([5, 6])
        setattr(req.sampling, field, value)
        err = grpc_error(router, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (err.details() or ""), err.details()
    ok = ids_req([5, 6], 2)
    ok.sampling.presence_penalty, ok.sampling.repetition_penalty = 0.5, 1.2
    assert generate(router, ok)[-1].usage.completion_tokens == 2
