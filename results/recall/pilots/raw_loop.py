"""Pilot: a plain training loop (AdamW, constant lr, no warmup, clip 1.0, 1 thread) of a 2-layer DiffLM on recall data,
printing the answer accuracy of the last 10 batches per training length every 50 steps, then an optional evaluation.

    PYTHONPATH=. python results/recall/pilots/raw_loop.py --lens 16 --pairs 2 4 --steps 400 --bt 4096
"""
import time, torch, sys, argparse
torch.set_num_threads(1)
import torch.nn.functional as F
from diffmm.data.recall import RecallTask, RecallStream, task_grid
from diffmm.models.lm import DiffLM, LMConfig
from diffmm.eval.recall import answer_logits, evaluate_recall
from diffmm.train.recall_run import matched_lm_kwargs
p=argparse.ArgumentParser()
p.add_argument("--lens",type=int,nargs="+"); p.add_argument("--pairs",type=int,nargs="+")
p.add_argument("--steps",type=int,default=600); p.add_argument("--lr",type=float,default=3e-3)
p.add_argument("--E",type=int,default=64); p.add_argument("--H",type=int,default=4); p.add_argument("--bt",type=int,default=4096)
p.add_argument("--noise",type=float,default=0); p.add_argument("--vocab",type=int,default=64); p.add_argument("--att",default="standard")
p.add_argument("--elens",type=int,nargs="+"); p.add_argument("--epairs",type=int,nargs="+")
p.add_argument("--seed",type=int,default=0)
a=p.parse_args()
kw=matched_lm_kwargs(a.att,a.E,a.H,2,a.vocab,512)
tasks,_=task_grid(a.vocab,a.lens,a.pairs,noise=a.noise)
print([t.name for t in tasks])
torch.manual_seed(a.seed)
m=DiffLM(LMConfig(**kw)); opt=torch.optim.AdamW(m.parameters(),a.lr,betas=(0.9,0.98),weight_decay=0.1)
it=iter(RecallStream(tasks,32,seed=a.seed,batch_tokens=a.bt))
t=time.perf_counter(); accs={}
for i in range(a.steps):
    b=next(it); lg,ans=answer_logits(m,b["inputs"],b["targets"]); l=F.cross_entropy(lg,ans); l.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(),1.0); opt.step(); opt.zero_grad()
    accs.setdefault(b["inputs"].shape[1],[]).append(float((lg.argmax(-1)==ans).float().mean()))
    if (i+1)%50==0: print(i+1, {k:round(sum(v[-10:])/len(v[-10:]),2) for k,v in sorted(accs.items())}, round(time.perf_counter()-t), flush=True)
if a.elens:
    et,_=task_grid(a.vocab,a.elens,a.epairs,noise=a.noise)
    r=evaluate_recall(m,et,examples=64,measure_attention=True,attention_examples=16,show_progress=False)
    print(r.to_markdown(a.att))
