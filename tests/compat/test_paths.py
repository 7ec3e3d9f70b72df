"""Every hivemind path the compatibility promise covers resolves, to Plexus's objects (plexus.compat)."""

import importlib
import subprocess
import sys
import textwrap

import pytest

from plexus.compat import __main__ as runner

pytestmark = pytest.mark.timeout(60)

# (hivemind module path, public names there): hivemind 1.1.12's package exports and the module paths
# its users import from.
PUBLIC_NAMES = {
    name: names.split()
    for name, names in {
        "hivemind": "DHT DecentralizedAverager GradScaler ModuleBackend Optimizer RemoteExpert "
        "RemoteMixtureOfExperts RemoteSwitchMixtureOfExperts Server TrainingAverager "
        "register_expert_class __version__ CollaborativeOptimizer DecentralizedSGD",
        "hivemind.dht": "DHT DHTNode DHTID DHTValue",
        "hivemind.dht.node": "DHTNode DHTID",
        "hivemind.dht.crypto": "RSASignatureValidator",
        "hivemind.dht.schema": "SchemaValidator BytesWithPublicKey",
        "hivemind.dht.validation": "DHTRecord RecordValidatorBase CompositeValidator",
        "hivemind.dht.routing": "DHTID",
        "hivemind.averaging": "DecentralizedAverager",
        "hivemind.averaging.control": "StepControl AveragingStage",
        "hivemind.optim": "GradScaler Optimizer TrainingAverager CollaborativeOptimizer DecentralizedOptimizer "
        "DecentralizedSGD DecentralizedAdam",
        "hivemind.optim.grad_averager": "GradientAverager GradientAveragerFactory",
        "hivemind.optim.power_sgd_averager": "PowerSGDGradientAverager",
        "hivemind.optim.progress_tracker": "ProgressTracker",
        "hivemind.optim.state_averager": "TrainingStateAverager",
        "hivemind.optim.collaborative": "CollaborativeOptimizer CollaborationState",
        "hivemind.compression": "BlockwiseQuantization CompressionBase CompressionInfo Float16Compression "
        "NoCompression PerTensorCompression Quantile8BitQuantization "
        "RoleAdaptiveCompression ScaledFloat16Compression SizeAdaptiveCompression "
        "TensorRole Uniform8BitQuantization deserialize_tensor_stream "
        "deserialize_torch_tensor serialize_torch_tensor",
        "hivemind.compression.adaptive": "AdaptiveCompressionBase PerTensorCompression",
        "hivemind.moe": "ModuleBackend RemoteExpert RemoteMixtureOfExperts RemoteSwitchMixtureOfExperts Server "
        "background_server declare_experts get_experts register_expert_class",
        "hivemind.moe.server": "ModuleBackend Server background_server declare_experts get_experts "
        "register_expert_class",
        "hivemind.moe.server.dht_handler": "declare_experts get_experts",
        "hivemind.moe.server.layers": "name_to_block name_to_input get_linear_schedule_with_warmup",
        "hivemind.moe.server.layers.lr_schedule": "get_linear_schedule_with_warmup",
        "hivemind.moe.client": "RemoteExpert RemoteMixtureOfExperts RemoteSwitchMixtureOfExperts",
        "hivemind.moe.client.expert": "RemoteExpert create_remote_experts",
        "hivemind.moe.client.beam_search": "MoEBeamSearcher",
        "hivemind.moe.expert_uid": "ExpertInfo is_valid_uid is_valid_prefix split_uid UID_DELIMITER",
        "hivemind.p2p": "P2P PeerID PeerInfo P2PDaemonError P2PHandlerError",
        "hivemind.utils": "get_dht_time get_logger MSGPackSerializer ValueWithExpiration TimedStorage "
        "PerformanceEMA nested_flatten nested_pack nested_map DHTExpiration "
        "MAX_DHT_TIME_DISCREPANCY_SECONDS TensorDescriptor",
        "hivemind.utils.logging": "get_logger use_hivemind_log_handler",
        "hivemind.utils.timed_storage": "get_dht_time ValueWithExpiration TimedStorage DHTExpiration",
        "hivemind.utils.serializer": "MSGPackSerializer",
        "hivemind.utils.performance_ema": "PerformanceEMA",
        "hivemind.utils.nested": "nested_flatten nested_pack nested_map",
        "hivemind.utils.tensor_descr": "TensorDescriptor BatchTensorDescriptor",
        "hivemind.utils.streaming": "split_for_streaming combine_from_streaming",
        "hivemind.utils.crypto": "RSAPrivateKey",
        "hivemind.utils.multiaddr": "Multiaddr",
        "hivemind.proto.runtime_pb2": "CompressionType",
    }.items()
}


@pytest.mark.parametrize("path", sorted(PUBLIC_NAMES))
def test_every_public_name_is_at_hiveminds_path(path):
    module = importlib.import_module(path)
    missing = [name for name in PUBLIC_NAMES[path] if not hasattr(module, name)]
    assert not missing, f"{path} lacks {missing}"


def test_the_objects_are_plexus_own():
    import hivemind
    from hivemind.dht import DHT
    from hivemind.utils.timed_storage import get_dht_time

    import plexus
    from plexus.utils import timing

    assert hivemind.DHT is DHT is plexus.DHT and get_dht_time is timing.get_dht_time
    assert hivemind.dht.DHTNode is plexus.dht.DHTNode and hivemind.utils.get_dht_time is get_dht_time


def test_star_import_and_missing_names_explain_themselves():
    namespace = {}
    exec("from hivemind.compression import *", namespace)
    assert "Float16Compression" in namespace and "serialize_torch_tensor" in namespace
    with pytest.raises(ImportError, match="no counterpart in Plexus.*coming-from-hivemind"):
        importlib.import_module("hivemind.no_such_module")
    import hivemind.dht

    with pytest.raises(AttributeError, match="coming-from-hivemind"):
        hivemind.dht.NoSuchName  # noqa: B018


def test_subpackages_export_hivemind_names_and_the_hook_is_refused_after_the_real_hivemind():
    """`import plexus as hivemind` reaches the same names through Plexus's own subpackages, without
    the hook; installing the hook once the real hivemind is imported is refused; uninstall undoes it."""
    code = textwrap.dedent("""
        import sys, types
        import plexus as hivemind
        assert hivemind.dht.DHTNode and hivemind.dht.DHTID and hivemind.averaging.DecentralizedAverager
        assert hivemind.utils.get_dht_time and hivemind.utils.PerformanceEMA
        assert hivemind.utils.MSGPackSerializer
        assert hivemind.moe.create_remote_experts and hivemind.optim.GradientAveragerFactory
        assert "hivemind" not in sys.modules
        sys.modules["hivemind"] = types.ModuleType("hivemind")  # stands for the real package, imported first
        import plexus.compat
        from plexus.errors import UsageError
        try:
            plexus.compat.install()
        except UsageError as error:
            assert "already imported" in str(error)
        else:
            raise AssertionError("install() accepted a process that already imported hivemind")
        del sys.modules["hivemind"]
        plexus.compat.install()
        import hivemind.dht
        plexus.compat.uninstall()
        assert "hivemind" not in sys.modules and not plexus.compat.installed()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr


def test_python_m_plexus_compat_runs_an_unedited_script(tmp_path):
    script = tmp_path / "uses_hivemind.py"
    script.write_text(
        "import sys\nfrom hivemind.utils import get_dht_time\nimport helper\n"
        "print(helper.VALUE, get_dht_time() > 0, sys.argv[1:])\n"
    )
    (tmp_path / "helper.py").write_text("VALUE = 'found next to the script'\n")
    result = subprocess.run(
        [sys.executable, "-m", "plexus.compat", str(script), "--flag", "x"],
        capture_output=True,
        text=True,
        timeout=50,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "found next to the script True ['--flag', 'x']"
    with pytest.raises(SystemExit) as usage:
        runner.main([])
    assert usage.value.code == 2
