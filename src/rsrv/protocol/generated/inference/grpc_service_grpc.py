import purerpc
import rsrv.protocol.generated.inference.grpc_service_pb2 as inference_dot_grpc_service__pb2
import rsrv.protocol.generated.inference.model_config_pb2 as inference_dot_model_config__pb2


class GRPCInferenceServiceServicer(purerpc.Servicer):
    async def ServerLive(self, input_message):
        raise NotImplementedError()

    async def ServerReady(self, input_message):
        raise NotImplementedError()

    async def ModelReady(self, input_message):
        raise NotImplementedError()

    async def ServerMetadata(self, input_message):
        raise NotImplementedError()

    async def ModelMetadata(self, input_message):
        raise NotImplementedError()

    async def ModelInfer(self, input_message):
        raise NotImplementedError()

    async def ModelStreamInfer(self, input_messages):
        raise NotImplementedError()

    async def ModelConfig(self, input_message):
        raise NotImplementedError()

    async def ModelStatistics(self, input_message):
        raise NotImplementedError()

    async def RepositoryIndex(self, input_message):
        raise NotImplementedError()

    async def RepositoryModelLoad(self, input_message):
        raise NotImplementedError()

    async def RepositoryModelUnload(self, input_message):
        raise NotImplementedError()

    async def SystemSharedMemoryStatus(self, input_message):
        raise NotImplementedError()

    async def SystemSharedMemoryRegister(self, input_message):
        raise NotImplementedError()

    async def SystemSharedMemoryUnregister(self, input_message):
        raise NotImplementedError()

    async def CudaSharedMemoryStatus(self, input_message):
        raise NotImplementedError()

    async def CudaSharedMemoryRegister(self, input_message):
        raise NotImplementedError()

    async def CudaSharedMemoryUnregister(self, input_message):
        raise NotImplementedError()

    async def TraceSetting(self, input_message):
        raise NotImplementedError()

    async def LogSettings(self, input_message):
        raise NotImplementedError()

    @property
    def service(self) -> purerpc.Service:
        service_obj = purerpc.Service(
            "inference.GRPCInferenceService"
        )
        service_obj.add_method(
            "ServerLive",
            self.ServerLive,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ServerLiveRequest,
                inference_dot_grpc_service__pb2.ServerLiveResponse,
            )
        )
        service_obj.add_method(
            "ServerReady",
            self.ServerReady,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ServerReadyRequest,
                inference_dot_grpc_service__pb2.ServerReadyResponse,
            )
        )
        service_obj.add_method(
            "ModelReady",
            self.ModelReady,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelReadyRequest,
                inference_dot_grpc_service__pb2.ModelReadyResponse,
            )
        )
        service_obj.add_method(
            "ServerMetadata",
            self.ServerMetadata,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ServerMetadataRequest,
                inference_dot_grpc_service__pb2.ServerMetadataResponse,
            )
        )
        service_obj.add_method(
            "ModelMetadata",
            self.ModelMetadata,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelMetadataRequest,
                inference_dot_grpc_service__pb2.ModelMetadataResponse,
            )
        )
        service_obj.add_method(
            "ModelInfer",
            self.ModelInfer,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelInferRequest,
                inference_dot_grpc_service__pb2.ModelInferResponse,
            )
        )
        service_obj.add_method(
            "ModelStreamInfer",
            self.ModelStreamInfer,
            purerpc.RPCSignature(
                purerpc.Cardinality.STREAM_STREAM,
                inference_dot_grpc_service__pb2.ModelInferRequest,
                inference_dot_grpc_service__pb2.ModelStreamInferResponse,
            )
        )
        service_obj.add_method(
            "ModelConfig",
            self.ModelConfig,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelConfigRequest,
                inference_dot_grpc_service__pb2.ModelConfigResponse,
            )
        )
        service_obj.add_method(
            "ModelStatistics",
            self.ModelStatistics,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelStatisticsRequest,
                inference_dot_grpc_service__pb2.ModelStatisticsResponse,
            )
        )
        service_obj.add_method(
            "RepositoryIndex",
            self.RepositoryIndex,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.RepositoryIndexRequest,
                inference_dot_grpc_service__pb2.RepositoryIndexResponse,
            )
        )
        service_obj.add_method(
            "RepositoryModelLoad",
            self.RepositoryModelLoad,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.RepositoryModelLoadRequest,
                inference_dot_grpc_service__pb2.RepositoryModelLoadResponse,
            )
        )
        service_obj.add_method(
            "RepositoryModelUnload",
            self.RepositoryModelUnload,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.RepositoryModelUnloadRequest,
                inference_dot_grpc_service__pb2.RepositoryModelUnloadResponse,
            )
        )
        service_obj.add_method(
            "SystemSharedMemoryStatus",
            self.SystemSharedMemoryStatus,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.SystemSharedMemoryStatusRequest,
                inference_dot_grpc_service__pb2.SystemSharedMemoryStatusResponse,
            )
        )
        service_obj.add_method(
            "SystemSharedMemoryRegister",
            self.SystemSharedMemoryRegister,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.SystemSharedMemoryRegisterRequest,
                inference_dot_grpc_service__pb2.SystemSharedMemoryRegisterResponse,
            )
        )
        service_obj.add_method(
            "SystemSharedMemoryUnregister",
            self.SystemSharedMemoryUnregister,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.SystemSharedMemoryUnregisterRequest,
                inference_dot_grpc_service__pb2.SystemSharedMemoryUnregisterResponse,
            )
        )
        service_obj.add_method(
            "CudaSharedMemoryStatus",
            self.CudaSharedMemoryStatus,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.CudaSharedMemoryStatusRequest,
                inference_dot_grpc_service__pb2.CudaSharedMemoryStatusResponse,
            )
        )
        service_obj.add_method(
            "CudaSharedMemoryRegister",
            self.CudaSharedMemoryRegister,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.CudaSharedMemoryRegisterRequest,
                inference_dot_grpc_service__pb2.CudaSharedMemoryRegisterResponse,
            )
        )
        service_obj.add_method(
            "CudaSharedMemoryUnregister",
            self.CudaSharedMemoryUnregister,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.CudaSharedMemoryUnregisterRequest,
                inference_dot_grpc_service__pb2.CudaSharedMemoryUnregisterResponse,
            )
        )
        service_obj.add_method(
            "TraceSetting",
            self.TraceSetting,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.TraceSettingRequest,
                inference_dot_grpc_service__pb2.TraceSettingResponse,
            )
        )
        service_obj.add_method(
            "LogSettings",
            self.LogSettings,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.LogSettingsRequest,
                inference_dot_grpc_service__pb2.LogSettingsResponse,
            )
        )
        return service_obj


class GRPCInferenceServiceStub:
    def __init__(self, channel):
        self._client = purerpc.Client(
            "inference.GRPCInferenceService",
            channel
        )
        self.ServerLive = self._client.get_method_stub(
            "ServerLive",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ServerLiveRequest,
                inference_dot_grpc_service__pb2.ServerLiveResponse,
            )
        )
        self.ServerReady = self._client.get_method_stub(
            "ServerReady",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ServerReadyRequest,
                inference_dot_grpc_service__pb2.ServerReadyResponse,
            )
        )
        self.ModelReady = self._client.get_method_stub(
            "ModelReady",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelReadyRequest,
                inference_dot_grpc_service__pb2.ModelReadyResponse,
            )
        )
        self.ServerMetadata = self._client.get_method_stub(
            "ServerMetadata",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ServerMetadataRequest,
                inference_dot_grpc_service__pb2.ServerMetadataResponse,
            )
        )
        self.ModelMetadata = self._client.get_method_stub(
            "ModelMetadata",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelMetadataRequest,
                inference_dot_grpc_service__pb2.ModelMetadataResponse,
            )
        )
        self.ModelInfer = self._client.get_method_stub(
            "ModelInfer",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelInferRequest,
                inference_dot_grpc_service__pb2.ModelInferResponse,
            )
        )
        self.ModelStreamInfer = self._client.get_method_stub(
            "ModelStreamInfer",
            purerpc.RPCSignature(
                purerpc.Cardinality.STREAM_STREAM,
                inference_dot_grpc_service__pb2.ModelInferRequest,
                inference_dot_grpc_service__pb2.ModelStreamInferResponse,
            )
        )
        self.ModelConfig = self._client.get_method_stub(
            "ModelConfig",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelConfigRequest,
                inference_dot_grpc_service__pb2.ModelConfigResponse,
            )
        )
        self.ModelStatistics = self._client.get_method_stub(
            "ModelStatistics",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.ModelStatisticsRequest,
                inference_dot_grpc_service__pb2.ModelStatisticsResponse,
            )
        )
        self.RepositoryIndex = self._client.get_method_stub(
            "RepositoryIndex",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.RepositoryIndexRequest,
                inference_dot_grpc_service__pb2.RepositoryIndexResponse,
            )
        )
        self.RepositoryModelLoad = self._client.get_method_stub(
            "RepositoryModelLoad",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.RepositoryModelLoadRequest,
                inference_dot_grpc_service__pb2.RepositoryModelLoadResponse,
            )
        )
        self.RepositoryModelUnload = self._client.get_method_stub(
            "RepositoryModelUnload",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.RepositoryModelUnloadRequest,
                inference_dot_grpc_service__pb2.RepositoryModelUnloadResponse,
            )
        )
        self.SystemSharedMemoryStatus = self._client.get_method_stub(
            "SystemSharedMemoryStatus",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.SystemSharedMemoryStatusRequest,
                inference_dot_grpc_service__pb2.SystemSharedMemoryStatusResponse,
            )
        )
        self.SystemSharedMemoryRegister = self._client.get_method_stub(
            "SystemSharedMemoryRegister",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.SystemSharedMemoryRegisterRequest,
                inference_dot_grpc_service__pb2.SystemSharedMemoryRegisterResponse,
            )
        )
        self.SystemSharedMemoryUnregister = self._client.get_method_stub(
            "SystemSharedMemoryUnregister",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.SystemSharedMemoryUnregisterRequest,
                inference_dot_grpc_service__pb2.SystemSharedMemoryUnregisterResponse,
            )
        )
        self.CudaSharedMemoryStatus = self._client.get_method_stub(
            "CudaSharedMemoryStatus",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.CudaSharedMemoryStatusRequest,
                inference_dot_grpc_service__pb2.CudaSharedMemoryStatusResponse,
            )
        )
        self.CudaSharedMemoryRegister = self._client.get_method_stub(
            "CudaSharedMemoryRegister",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.CudaSharedMemoryRegisterRequest,
                inference_dot_grpc_service__pb2.CudaSharedMemoryRegisterResponse,
            )
        )
        self.CudaSharedMemoryUnregister = self._client.get_method_stub(
            "CudaSharedMemoryUnregister",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.CudaSharedMemoryUnregisterRequest,
                inference_dot_grpc_service__pb2.CudaSharedMemoryUnregisterResponse,
            )
        )
        self.TraceSetting = self._client.get_method_stub(
            "TraceSetting",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.TraceSettingRequest,
                inference_dot_grpc_service__pb2.TraceSettingResponse,
            )
        )
        self.LogSettings = self._client.get_method_stub(
            "LogSettings",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                inference_dot_grpc_service__pb2.LogSettingsRequest,
                inference_dot_grpc_service__pb2.LogSettingsResponse,
            )
        )
