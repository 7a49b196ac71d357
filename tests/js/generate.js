// Streams one Generate from an lmgate server and prints the result as JSON: node generate.js HOST:PORT PROMPT
// With LMGATE_TLS_CA (a PEM file) the channel is TLS; LMGATE_API_KEY is sent as a bearer token.
const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const protoDir = path.join(__dirname, "..", "..", "protos");
const def = protoLoader.loadSync("lmgate/v1/lmgate.proto", { includeDirs: [protoDir], keepCase: true, longs: String, enums: String, defaults: true });
const lmgate = grpc.loadPackageDefinition(def).lmgate.v1;

const [target, prompt] = process.argv.slice(2);
const ca = process.env.LMGATE_TLS_CA;
const credentials = ca ? grpc.credentials.createSsl(fs.readFileSync(ca)) : grpc.credentials.createInsecure();
const metadata = new grpc.Metadata();
if (process.env.LMGATE_API_KEY) metadata.set("authorization", `Bearer ${process.env.LMGATE_API_KEY}`);
const client = new lmgate.Inference(target, credentials);
const call = client.Generate({ prompt, sampling: { max_new_tokens: 16, ignore_eos: true } }, metadata);
const result = { token_ids: [], text: "", messages: 0, finish_reason: null, usage: null };
call.on("data", (msg) => {
  result.messages += 1;
  result.token_ids.push(...msg.token_ids);
  result.text += msg.text;
  if (msg.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
    result.finish_reason = msg.finish_reason;
    result.usage = msg.usage;
  }
});
call.on("error", (err) => {
  console.error(`error: ${err.code} ${err.details}`);
  process.exit(1);
});
call.on("end", () => {
  console.log(JSON.stringify(result));
  client.close();
});
