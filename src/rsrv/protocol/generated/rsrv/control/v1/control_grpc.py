import purerpc
import rsrv.protocol.generated.rsrv.control.v1.control_pb2 as rsrv_dot_control_dot_v1_dot_control__pb2


class ControlServiceServicer(purerpc.Servicer):
    async def ModelControlStatus(self, input_message):
        raise NotImplementedError()

    async def SetModelResidency(self, input_message):
        raise NotImplementedError()

    async def SetModelPolicy(self, input_message):
        raise NotImplementedError()

    async def CompactMemory(self, input_message):
        raise NotImplementedError()

    @property
    def service(self) -> purerpc.Service:
        service_obj = purerpc.Service(
            "rsrv.control.v1.ControlService"
        )
        service_obj.add_method(
            "ModelControlStatus",
            self.ModelControlStatus,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_control_dot_v1_dot_control__pb2.ModelControlStatusRequest,
                rsrv_dot_control_dot_v1_dot_control__pb2.ModelControlStatusResponse,
            )
        )
        service_obj.add_method(
            "SetModelResidency",
            self.SetModelResidency,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_control_dot_v1_dot_control__pb2.SetModelResidencyRequest,
                rsrv_dot_control_dot_v1_dot_control__pb2.SetModelResidencyResponse,
            )
        )
        service_obj.add_method(
            "SetModelPolicy",
            self.SetModelPolicy,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_control_dot_v1_dot_control__pb2.SetModelPolicyRequest,
                rsrv_dot_control_dot_v1_dot_control__pb2.SetModelPolicyResponse,
            )
        )
        service_obj.add_method(
            "CompactMemory",
            self.CompactMemory,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_control_dot_v1_dot_control__pb2.CompactMemoryRequest,
                rsrv_dot_control_dot_v1_dot_control__pb2.CompactMemoryResponse,
            )
        )
        return service_obj


class ControlServiceStub:
    def __init__(self, channel):
        self._client = purerpc.Client(
            "rsrv.control.v1.ControlService",
            channel
        )
        self.ModelControlStatus = self._client.get_method_stub(
            "ModelControlStatus",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_control_dot_v1_dot_control__pb2.ModelControlStatusRequest,
                rsrv_dot_control_dot_v1_dot_control__pb2.ModelControlStatusResponse,
            )
        )
        self.SetModelResidency = self._client.get_method_stub(
            "SetModelResidency",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_control_dot_v1_dot_control__pb2.SetModelResidencyRequest,
                rsrv_dot_control_dot_v1_dot_control__pb2.SetModelResidencyResponse,
            )
        )
        self.SetModelPolicy = self._client.get_method_stub(
            "SetModelPolicy",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_control_dot_v1_dot_control__pb2.SetModelPolicyRequest,
                rsrv_dot_control_dot_v1_dot_control__pb2.SetModelPolicyResponse,
            )
        )
        self.CompactMemory = self._client.get_method_stub(
            "CompactMemory",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                rsrv_dot_control_dot_v1_dot_control__pb2.CompactMemoryRequest,
                rsrv_dot_control_dot_v1_dot_control__pb2.CompactMemoryResponse,
            )
        )
