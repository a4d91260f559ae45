"""A full fine-tune saved at a remote URL and loaded (S3 against a moto server in a process of its own): the
driver's anonymous memory during the load (RssAnon, sampled every 5 ms) and what transform would send (the
pickled handle, or the pickled model). `held`: held_saved (the handle: the config and the weights' headers
read); `built`: load_module, the model built whole on the driver (how a remote URL loaded before). A Llama of
hidden 1024, 12 layers (122M parameters, 487 MB in float32). Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_remote_load.py held|built
"""
import os, sys, time, threading
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
import torch, cloudpickle, boto3, s3fs
from transformers import LlamaConfig, LlamaForCausalLM
from estimator.predict.weights import held_saved, load_module, save_module

def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
class Peak:
    def __enter__(self):
        self.base = anon(); self.peak = self.base; self.run = True
        def watch():
            while self.run:
                self.peak = max(self.peak, anon()); time.sleep(0.005)
        self.t = threading.Thread(target=watch); self.t.start(); return self
    def __exit__(self, *a):
        self.run = False; self.t.join(); self.peak = max(self.peak, anon())
import subprocess, socket
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close(); host = "127.0.0.1"
server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", host, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(3)
opts = {"key": "AK", "secret": "SK", "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"}}
boto3.client("s3", endpoint_url=opts["client_kwargs"]["endpoint_url"], aws_access_key_id="AK", aws_secret_access_key="SK", region_name="us-east-1").create_bucket(Bucket="runs")
fs = s3fs.S3FileSystem(**opts)
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)
model = LlamaForCausalLM(cfg)
n = sum(p.numel() for p in model.parameters())
save_module(model, None, None, fs, "runs/m")
size = sum(fs.size(p) for p in fs.find("runs/m"))
del model
import gc; gc.collect()
print(f"model {n/1e6:.0f}M params, saved {size/1e6:.0f} MB on S3 (moto)")
way = sys.argv[1]
with Peak() as p:
    if way == "held":
        skeleton, opt, handle = held_saved(fs, "runs/m")
        sent = len(cloudpickle.dumps(handle))
    else:
        model, opt = load_module(fs, "runs/m", lambda: None)
        sent = len(cloudpickle.dumps(model))
print(f"{way}: driver anon peak +{p.peak - p.base:.0f} MB, held after +{anon() - p.base:.0f} MB, transform sends {sent/1e3:.1f} KB")
server.terminate()
