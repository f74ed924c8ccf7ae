# Checked by tests/typing/test_typing.py: each line marked E must be a mypy error.
from bus import Origin
from messages import BatchTokenIDOut, Output, RpcReqInput, RpcReqOutput
from router import CallbackSink, Router


def only_rpc(output: RpcReqOutput, origin: Origin) -> None: ...


def any_output(output: Output, origin: Origin) -> None: ...


router: Router[Output] = Router(Output)
rpc_sink = CallbackSink(only_rpc)
router.register(RpcReqOutput, rpc_sink)
router.register(BatchTokenIDOut, CallbackSink(any_output))  # fine: contravariance
router.register(BatchTokenIDOut, rpc_sink)  # E: a sink that only takes RpcReqOutput
router.route(RpcReqInput(rid="a", method="m"), Origin("rpc"))  # E: a request is not an output
reveal_type(router.sink_for(RpcReqOutput))  # R: router.router.Sink[messages.base.Output]
reveal_type(router.route(RpcReqOutput(rid="a", success=True), Origin("rpc")))  # R: bool
