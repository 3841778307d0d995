// Decode rftstream experience messages in JavaScript with @msgpack/msgpack (no rftstream).
//
// The body of a message on rft.<run>.exp.<stage> is one msgpack map, schema
// rft.experience.v1 (`rftstream schema` prints its JSON Schema). Arrays arrive as msgpack
// bin values (Uint8Array) of little-endian elements: tokens, chosen, rejected, banned_ids:
// int32; logprobs, advantages, returns, token_level_reward, allowed_logprobs: float32;
// action_mask: one byte, 0/1.
// tokens is the prompt and the response; the per-token arrays cover the response only.
//
// Usage: node decode_experience.mjs BODY_FILE...   (one JSON line per experience)
import { readFileSync } from "node:fs";
import { decode } from "@msgpack/msgpack";

const SCHEMA = "rft.experience.v1";

function array(bytes, kind) {
  if (bytes == null) return null;
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = [];
  for (let i = 0; i < bytes.byteLength; i += 4) {
    out.push(kind === "int32" ? view.getInt32(i, true) : view.getFloat32(i, true));
  }
  return out;
}

export function experiences(body) {
  const group = decode(body);
  if (group.schema !== SCHEMA) throw new Error(`not a ${SCHEMA} message: ${group.schema}`);
  return group.experiences.map((e) => {
    const tokens = array(e.tokens, "int32");
    const response = tokens.length - e.prompt_length;
    return {
      uid: e.eid.join("/"),
      group_id: group.group_id,
      producer: group.producer ?? "",
      prompt_length: e.prompt_length,
      reward: e.reward ?? null,
      model_version: e.model_version ?? 0,
      tokens,
      logprobs: array(e.logprobs, "float32"),
      advantages: array(e.advantages, "float32"),
      action_mask: e.action_mask == null ? new Array(response).fill(1) : Array.from(e.action_mask),
      metrics: e.metrics ?? {},
    };
  });
}

for (const path of process.argv.slice(2)) {
  for (const line of experiences(readFileSync(path))) console.log(JSON.stringify(line));
}
