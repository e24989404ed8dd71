-- Quick check of editors/nvim's plugin without waiting for a model, run by tests/test_nvim.py.
-- Environment: EMBER_E2E_OUT (JSON result), EMBER_E2E_FILE (a Python file), and either
-- EMBER_E2E_CMD (JSON list: server command) or EMBER_E2E_TCP ("host:port" of `ember --tcp`),
-- EMBER_E2E_TOKEN (optional token sent in initializationOptions).
-- It sets up the plugin, opens the file, waits for the server's initialize reply and reports
-- what the client saw.
local out = {}

local function main()
  local v = vim.version()
  out.nvim_version = string.format('%d.%d.%d', v.major, v.minor, v.patch)
  local ember = require('ember')
  out.parse_tcp = {}
  for _, s in ipairs({ '127.0.0.1:7777', '[::1]:8080', '9000', 'gpu-box:1234' }) do
    local host, port = ember.parse_tcp(s)
    table.insert(out.parse_tcp, { s, host, port })
  end
  local opts = { filetypes = { 'python' }, settings = { maxTokens = 8 } }
  local server_env = os.getenv('EMBER_E2E_SERVER_ENV')
  if server_env then
    opts.cmd_env = vim.fn.json_decode(server_env)
  end
  if os.getenv('EMBER_E2E_TCP') and os.getenv('EMBER_E2E_TCP') ~= '' then
    opts.tcp = os.getenv('EMBER_E2E_TCP')
    opts.settings.token = os.getenv('EMBER_E2E_TOKEN')
  else
    opts.cmd = vim.fn.json_decode(os.getenv('EMBER_E2E_CMD'))
  end
  ember.setup(opts)
  vim.cmd('edit ' .. vim.fn.fnameescape(os.getenv('EMBER_E2E_FILE')))
  local bufnr = vim.api.nvim_get_current_buf()
  out.filetype = vim.bo[bufnr].filetype
  local client
  out.initialized = vim.wait(tonumber(os.getenv('EMBER_E2E_TIMEOUT') or '60') * 1000, function()
    local list = vim.lsp.get_clients and vim.lsp.get_clients({ bufnr = bufnr })
      or vim.tbl_values(vim.lsp.buf_get_clients(bufnr))
    for _, c in ipairs(list) do
      if c.name == 'ember' and c.initialized and c.server_capabilities then
        client = c
        return true
      end
    end
    return false
  end, 100)
  if client then
    out.client_name = client.name
    out.completion_provider = client.server_capabilities.completionProvider ~= nil
    out.inline_completion_provider = client.server_capabilities.inlineCompletionProvider ~= nil
    out.init_options = client.config.init_options
    out.settings = client.config.settings
  end
  out.omnifunc = vim.bo[bufnr].omnifunc
  out.status = ember.status()
end

local ok, err = xpcall(main, debug.traceback)
out.ok = ok
if not ok then
  out.error = tostring(err)
end
local f = io.open(os.getenv('EMBER_E2E_OUT'), 'w')
f:write(vim.fn.json_encode(out))
f:close()
for _, c in ipairs(vim.lsp.get_clients and vim.lsp.get_clients() or vim.lsp.get_active_clients()) do
  pcall(vim.lsp.stop_client, c.id, true)
end
vim.cmd('qa!')
