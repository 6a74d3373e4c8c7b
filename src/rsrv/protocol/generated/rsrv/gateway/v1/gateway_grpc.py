import purerpc
import rsrv.protocol.generated.rsrv.gateway.v1.gateway_pb2 as rsrv_dot_gateway_dot_v1_dot_gateway__pb2


class GatewayControlServicer(purerpc.Servicer):
    async def GetSchedulingStatus(self, input_message):
        raise NotImplementedError()

    async def SetSchedulingPolicy(self, input_message):
        raise NotImplementedError()

    async def SetModelPlacement(self, input_message):
        raise NotImplementedError()

    async def Repack(self, input_message):
        raise NotImplementedError()

    @property
    def service(self) -> purerpc.Service:
        service_obj = purerpc.Service(
            "rsrv.gateway.v1.GatewayControl"
        )
        service_obj.add_method(
            "GetSchedulingStatus",
            self.GetSchedulingStatus,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.GetSchedulingStatusRequest,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SchedulingStatus,
            )
        )
        service_obj.add_method(
            "SetSchedulingPolicy",
            self.SetSchedulingPolicy,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SetSchedulingPolicyRequest,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SetSchedulingPolicyResponse,
            )
        )
        service_obj.add_method(
            "SetModelPlacement",
            self.SetModelPlacement,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SetModelPlacementRequest,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SetModelPlacementResponse,
            )
        )
        service_obj.add_method(
            "Repack",
            self.Repack,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.RepackRequest,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.RepackResponse,
            )
        )
        return service_obj


class GatewayControlStub:
    def __init__(self, channel):
        self._client = purerpc.Client(
            "rsrv.gateway.v1.GatewayControl",
            channel
        )
        self.GetSchedulingStatus = self._client.get_method_stub(
            "GetSchedulingStatus",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.GetSchedulingStatusRequest,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SchedulingStatus,
            )
        )
        self.SetSchedulingPolicy = self._client.get_method_stub(
            "SetSchedulingPolicy",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SetSchedulingPolicyRequest,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SetSchedulingPolicyResponse,
            )
        )
        self.SetModelPlacement = self._client.get_method_stub(
            "SetModelPlacement",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SetModelPlacementRequest,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.SetModelPlacementResponse,
            )
        )
        self.Repack = self._client.get_method_stub(
            "Repack",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.RepackRequest,
                rsrv_dot_gateway_dot_v1_dot_gateway__pb2.RepackResponse,
            )
        )
