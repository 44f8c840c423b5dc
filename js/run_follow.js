// Anima Trainer pack: which training run a Train node's chart follows — no ComfyUI imports, tested under node.
//
// Every `anima_train.progress` event names the node ("5", or "12:5" inside subgraph node 12) and the prompt it runs
// for (`prompt_id`: the id the server answered when the prompt was queued; ComfyUI's `executing` messages carry the
// same id). A node id alone is not enough: the same workflow file open in two workflow tabs, or two different
// workflows that both have a Train node 5, would all draw one run, and a prompt queued without a client id (a
// script, another page on the API) is sent to every page.
//
// The rule: a page follows the prompts it queued itself, and a chart only the prompts queued from the workflow on
// the canvas now.
//  * js/anima_train.js wraps api.queuePrompt: for each prompt it queues, the server's prompt id and the id of the
//    workflow it came from (`workflow.id` of the queued graph: LiteGraph's graph id, a UUID saved in the workflow)
//    are remembered here — in sessionStorage too, so a reload mid-run keeps following it.
//  * Every event's state is kept under (prompt id, node id), whoever queued it: the server may send the first events
//    (a re-used run's "done" comes at once) before the queue request has returned.
//  * A node's chart shows, of the runs of its node id whose prompt this page queued from the current workflow, the
//    one updated last. Runs of other workflows wait until their tab is shown again; runs of prompts this page did
//    not queue are never drawn.
//  * An event without a prompt id (a pack version before this rule) is followed by node id alone, as before.
// Limit: two tabs of one workflow share its id, so both follow its runs — they show the same graph.

export const MAX_PROMPTS = 64; // prompts remembered per page (queue order); older ones are forgotten
export const STORAGE_KEY = "anima_train.queued_prompts";

export function runKey(promptId, nodeId) {
  return `${promptId ?? ""}|${nodeId}`;
}

function nodeOfKey(key) {
  return key.slice(key.indexOf("|") + 1);
}

function promptOfKey(key) {
  return key.slice(0, key.indexOf("|"));
}

export class PromptBook {
  // storage: a Storage (window.sessionStorage) or null; never required (privacy modes throw on access)
  constructor(storage = null) {
    this.storage = storage;
    this.graphs = new Map(); // prompt id -> workflow id, in queue order
    try {
      const saved = JSON.parse(storage?.getItem(STORAGE_KEY) ?? "[]");
      for (const [prompt, graph] of Array.isArray(saved) ? saved : []) this.graphs.set(String(prompt), String(graph));
    } catch {
      // unreadable: start empty
    }
  }

  remember(promptId, graphId) {
    if (promptId === undefined || promptId === null) return;
    this.graphs.delete(String(promptId));
    this.graphs.set(String(promptId), String(graphId ?? ""));
    while (this.graphs.size > MAX_PROMPTS) this.graphs.delete(this.graphs.keys().next().value);
    try {
      this.storage?.setItem(STORAGE_KEY, JSON.stringify([...this.graphs]));
    } catch {
      // full or forbidden: this page still follows it until a reload
    }
  }

  // The workflow a prompt was queued from, or undefined when this page did not queue it.
  graphOf(promptId) {
    return this.graphs.get(String(promptId));
  }
}

// May an event be drawn on the canvas that now shows workflow `graphId`?
export function follows(book, promptId, graphId) {
  if (promptId === undefined || promptId === null || promptId === "") return true; // no prompt id: as before
  return book.graphOf(promptId) === String(graphId ?? "");
}

// The key (runKey) of the run the chart of node `nodeId` shows on workflow `graphId`, or null. `runs` is a Map kept
// in update order (the last entry was updated last).
export function chartRunKey(book, runs, nodeId, graphId) {
  let found = null;
  for (const key of runs.keys()) {
    if (nodeOfKey(key) === String(nodeId) && follows(book, promptOfKey(key), graphId)) found = key;
  }
  return found;
}
